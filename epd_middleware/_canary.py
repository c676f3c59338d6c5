"""The canary encode: a tiny built-in image an encoder must encode before it may be ejected.

A server that failed ``eject_after`` calls in a row may have failed them for its requests (media that
cannot be fetched or decoded, options it refuses): the canary asks it to do its job with nothing of any
client's in the call, so its answer is evidence about the server alone (:func:`._probes.confirm_failing`).
The image is 56 x 56 pixels, the smallest Qwen2-VL's processor takes without resizing (min_pixels 3136),
made here, so no file ships with the package.
"""

from __future__ import annotations

import base64
import functools
import struct
import zlib
from collections.abc import Mapping
from typing import Any, NamedTuple

from ._handles import match_reply
from ._plan import MediaItem
from ._protocol import EC_TRANSFER_PARAMS, UUID, embedding_stored
from ._surfaces import encoder_request
from ._upstream import Attempt
from .errors import UpstreamBadReply
from .transport import Body

__all__ = ["CANARY_UUID", "Canary", "canary"]

_SIDE = 56
# Pinned, so that the encoder reports it as the hash (no options) and the one file it writes under
# ECExampleConnector's storage has a name of its own, overwritten by every canary.
CANARY_UUID = "epd-canary-v1"


def _png(side: int) -> bytes:
    """A ``side`` x ``side`` RGB PNG of four coloured squares."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    half = side // 2
    rows = []
    for y in range(side):
        row = bytearray(b"\0")  # filter: none
        for x in range(side):
            row += (b"\xd0\x30\x30", b"\x30\xa0\x30", b"\x30\x30\xd0", b"\xe0\xc0\x20")[
                (y >= half) * 2 + (x >= half)
            ]
        rows.append(bytes(row))
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"".join(rows)))
        + chunk(b"IEND", b"")
    )


_DATA_URL = "data:image/png;base64," + base64.b64encode(_png(_SIDE)).decode()
_ITEM = MediaItem(
    CANARY_UUID, "image", {"type": "image_url", "image_url": {"url": _DATA_URL}, UUID: CANARY_UUID}
)


class Canary(NamedTuple):
    """The canary call for encoders that serve ``model``: an image only, none of a client's options,
    its answer read as every encoder answer is (a handle for the item; under ``storage``, the embedding
    where the local connector would look). ``headers``: the operator's key for it, never a client's (a
    client's key may be refused or throttled, which says nothing of the server). Made for every request
    that may need it, so its body is built only when a confirmation asks."""

    model: str
    storage: str | None
    headers: Mapping[str, str]

    def attempt(self, model: str | None = None) -> Attempt[None]:
        """One try of the canary, under ``model`` where the server serves another of this server's
        names than the request's."""
        storage = self.storage

        def read(server: str, reply: dict[str, Any]) -> None:
            handles = match_reply(server, (_ITEM,), reply.get(EC_TRANSFER_PARAMS))
            if not handles:
                raise UpstreamBadReply(server, "the canary image got no handle")
            if storage is not None:
                for handle in handles.values():
                    if not embedding_stored(storage, handle.mm_hash):
                        raise UpstreamBadReply(server, "the canary's embedding is not in the shared storage")

        return Attempt(_body(model or self.model), read)

    @property
    def carries_key(self) -> bool:
        return "authorization" in self.headers

    def keyless(self) -> Canary:
        """The same canary without the operator's key (for a server outside the pool)."""
        return self._replace(headers={})


def canary(model: str, storage: str | None, authorization: str | None) -> Canary:
    """The canary for encoders that serve ``model``; ``authorization``: the operator's key for it
    (:attr:`~epd_middleware.EPDConfig.canary_authorization`)."""
    return Canary(model, storage, {"authorization": authorization} if authorization is not None else {})


@functools.lru_cache(maxsize=16)
def _body(model: str) -> Body:
    return encoder_request(model, [_ITEM.part], {}, None)
