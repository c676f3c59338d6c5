"""Request headers on the wire."""

from __future__ import annotations

from collections.abc import Mapping

from ._errors import UnsendableRequest

__all__ = ["header_lines"]


def header_lines(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """Header names and values as bytes, in Latin-1 (how the middleware decodes a request's header bytes),
    so a header a client sent goes on byte for byte. :class:`UnsendableRequest` for a value that
    would end the line (CR, LF, NUL) or has no Latin-1 byte."""
    lines = []
    for name, value in headers.items():
        try:
            raw = value.encode("latin-1")
        except UnicodeEncodeError:
            raise UnsendableRequest(f"header {name!r} holds a character that HTTP/1.1 cannot carry") from None
        if b"\r" in raw or b"\n" in raw or b"\0" in raw:
            raise UnsendableRequest(f"header {name!r} holds a line break or NUL")
        lines.append((name.encode("latin-1"), raw))
    return lines
