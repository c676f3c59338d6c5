"""EPDConfig: every option of the middleware, its default and its ``EPD_*`` environment variable.

This is the one place defaults live. The middleware's keyword arguments, ``EPDConfig(...)`` and the
environment are three spellings of the same model, so they cannot drift apart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["ENV_PREFIX", "EPDConfig"]

ENV_PREFIX = "EPD_"


class EPDConfig(BaseModel):
    """Configuration of :class:`~epd_middleware.EPDMiddleware`.

    Every field can also be set from the environment as ``EPD_<FIELD NAME IN CAPITALS>``; list fields
    take comma-separated values (``EPD_ENCODERS=http://enc-0:8001,http://enc-1:8001``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    encoders: tuple[str, ...] = Field(
        description="Base URLs of the vLLM encoder instances (ec_producer), e.g. http://enc-0:8001.",
    )
    encoder_timeout: float = Field(
        default=60.0,
        gt=0,
        description="Seconds one encoder call may take, connect to last byte; past it the client gets 504.",
    )
    paths: tuple[str, ...] = Field(
        default=("/v1/chat/completions",),
        description="Request paths whose POST bodies are examined; everything else passes through.",
    )
    max_body_bytes: int = Field(
        default=64 * 1024 * 1024,
        gt=0,
        description="Largest request body read on an intercepted path; larger ones get 413.",
    )
    max_batch_size: int = Field(
        default=8,
        ge=1,
        description="Most images sent to one encoder in one request.",
    )
    rewrite: bool = Field(
        default=True,
        description=(
            "Replace encoded media parts by metadata-only references (image_embeds, ...) so that PD does "
            "not decode or preprocess the media again."
        ),
    )
    trust_client_uuid: bool = Field(
        default=False,
        description=(
            "Keep the uuid a client put on a media part as its cache key. Off by default: a client uuid is "
            "a key every client shares, so one client could make another receive its embedding."
        ),
    )

    @field_validator("encoders")
    @classmethod
    def _check_encoders(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        if not urls:
            raise ValueError("at least one encoder URL is required (EPD_ENCODERS or encoders=[...])")
        cleaned = []
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"encoder URL {url!r} is not an http(s) URL with a host")
            if parts.query or parts.fragment:
                raise ValueError(f"encoder URL {url!r} must not carry a query or fragment")
            cleaned.append(url.rstrip("/"))
        if len(set(cleaned)) != len(cleaned):
            raise ValueError(f"encoder URLs are repeated: {list(urls)}")
        return tuple(cleaned)

    @field_validator("paths")
    @classmethod
    def _check_paths(cls, paths: tuple[str, ...]) -> tuple[str, ...]:
        for path in paths:
            if not path.startswith("/"):
                raise ValueError(f"path {path!r} must start with '/'")
        return paths

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EPDConfig:
        """Read the configuration from ``EPD_*`` variables (``os.environ`` by default)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, field in cls.model_fields.items():
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is None:
                continue
            if _is_sequence_field(field.annotation):
                values[name] = tuple(item.strip() for item in raw.split(",") if item.strip())
            else:
                values[name] = raw.strip()
        if "encoders" not in values:
            raise ValueError(
                f"invalid EPD_* environment configuration: {cls.env_var('encoders')} is not set; give the "
                "encoder base URLs, comma-separated (EPD_ENCODERS=http://enc-0:8001,http://enc-1:8001)"
            )
        try:
            return cls(**values)
        except ValidationError as exc:
            problems = "; ".join(
                f"{cls.env_var(str(error['loc'][0]))}: {error['msg']}" if error["loc"] else error["msg"]
                for error in exc.errors()
            )
            raise ValueError(f"invalid EPD_* environment configuration: {problems}") from None

    @classmethod
    def env_var(cls, field: str) -> str:
        """The environment variable that sets ``field``."""
        if field not in cls.model_fields:
            raise KeyError(field)
        return ENV_PREFIX + field.upper()


def _is_sequence_field(annotation: Any) -> bool:
    return getattr(annotation, "__origin__", None) is tuple
