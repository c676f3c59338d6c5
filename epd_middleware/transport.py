"""How encoder calls reach the network: the built-in HTTP/1.1 client (``_http/``) by default, or the
user's ``httpx.AsyncClient`` (their limits, auth, proxies; tests pass an ``httpx.MockTransport``).

Both speak one small interface and raise the same errors, so the encoder layer does not care which.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import httpx

from ._http import Body, ConnectFailed, ConnectionLost, HTTPClient, HTTPError, UnsendableRequest, header_lines

__all__ = [
    "Body",
    "ConnectFailed",
    "ConnectionLost",
    "HTTPClient",
    "HTTPError",
    "HttpxTransport",
    "Transport",
    "UnsendableRequest",
]


class Transport(Protocol):
    """``request`` returns (status, body) or raises TimeoutError or :class:`HTTPError`; a request that
    cannot be written (its headers) raises :class:`UnsendableRequest` before anything is sent."""

    @property
    def is_closed(self) -> bool: ...

    async def request(
        self, method: str, url: str, body: Body = b"", headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes]: ...

    async def drop_idle(self, url: str) -> None:
        """Close the idle connections to ``url``'s origin (after an answer that was not this call's)."""
        ...

    async def aclose(self) -> None: ...


class HttpxTransport:
    """An injected ``httpx.AsyncClient`` behind :class:`Transport`; never closed here."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    @property
    def is_closed(self) -> bool:
        return self.client.is_closed

    async def request(
        self, method: str, url: str, body: Body = b"", headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes]:
        content = body if isinstance(body, bytes) else b"".join(body)
        # As bytes: httpx encodes str header values as ASCII, so a client's Latin-1 header byte would
        # fail the call before it is sent (and be counted against the server).
        lines = header_lines(headers or {})
        try:
            response = await self.client.request(method, url, content=content or None, headers=lines)
        except httpx.TimeoutException:
            raise TimeoutError from None
        except httpx.ConnectError:
            raise ConnectFailed("connection failed") from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
            raise ConnectionLost("connection closed before a complete answer") from None
        except httpx.TransportError as exc:
            raise HTTPError(type(exc).__name__) from None
        return response.status_code, response.content

    async def drop_idle(self, url: str) -> None:
        """httpx keeps its pool to itself: the call still fails over, but its connections stay httpx's."""

    async def aclose(self) -> None:
        """The user's client is the user's to close."""
