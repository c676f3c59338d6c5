"""Typed errors of the request path and the OpenAI-style JSON bodies clients see for them."""

from __future__ import annotations

from http import HTTPStatus

import msgspec

__all__ = [
    "BodyTooLarge",
    "EPDError",
    "EncoderBadReply",
    "EncoderError",
    "EncoderStatusError",
    "EncoderTimeout",
    "EncoderUnavailable",
]

_encode = msgspec.json.Encoder().encode


class EPDError(Exception):
    """An error answered to the client instead of calling the local engine."""

    status: int = 500

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def error_type(self) -> str:
        # vLLM names its error types after the status phrase ("BadRequestError"); follow it so clients
        # see one convention whether the error came from vLLM or from the middleware.
        return HTTPStatus(self.status).phrase.replace(" ", "").replace("-", "") + "Error"

    def body(self) -> bytes:
        return _encode(
            {
                "error": {
                    "message": self.message,
                    "type": self.error_type,
                    "param": self.param,
                    "code": self.status,
                }
            }
        )

    def headers(self) -> list[tuple[bytes, bytes]]:
        return []


class BodyTooLarge(EPDError):
    status = 413

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body is larger than the limit of {limit} bytes")
        self.limit = limit


class EncoderError(EPDError):
    """An encoder call that did not give usable handles; names the encoder and the reason."""

    status = 502

    def __init__(self, encoder: str, reason: str) -> None:
        super().__init__(f"encoder {encoder} failed: {reason}")
        self.encoder = encoder
        self.reason = reason


class EncoderUnavailable(EncoderError):
    """The encoder could not be reached (connection refused, reset, DNS)."""


class EncoderTimeout(EncoderError):
    status = 504


class EncoderStatusError(EncoderError):
    """The encoder answered with a status other than 200."""

    def __init__(self, encoder: str, status_code: int, detail: str) -> None:
        super().__init__(encoder, f"HTTP {status_code}: {detail}" if detail else f"HTTP {status_code}")
        self.status_code = status_code


class EncoderBadReply(EncoderError):
    """The encoder answered 200 with a body the middleware cannot use."""
