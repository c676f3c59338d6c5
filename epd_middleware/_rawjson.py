"""JSON decoding that leaves long strings as the bytes they arrived as.

A multimodal body is mostly base64: 8 images are 1.6 MB of it. Decoding those strings into ``str`` and
encoding them again into every outgoing body costs about 1.2 ms a megabyte each way, and the middleware
never needs their text: it hashes them and forwards them. So long strings (at least
:data:`LONG_STRING` bytes, no backslash escape) are found with ``memchr`` jumps from quote to quote,
replaced by short placeholders before the body is decoded, and come back in the decoded value as
:class:`msgspec.Raw` views of the original body: encoded again verbatim, hashed without a copy.

For a valid JSON body the result equals a plain decode, apart from the type of those strings (their
bytes without the quotes are exactly the UTF-8 of their text, since they hold no escapes). A body that
is not valid JSON is refused as a plain decode refuses it, a raw control character inside a long string
included: each long string is checked where it lies (a scan in C, several GB/s), so a raw string is
always valid JSON text, read as text wherever it is needed, and never forwarded as something the server
that receives it would refuse (vLLM's parser refuses such a body as a whole).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import msgspec

__all__ = ["LONG_STRING", "Bytes", "Raw", "decode", "encode_pieces", "raw_text", "text_of"]

Raw = msgspec.Raw
# A body as read: bytes, or a buffer the exchange reads large bodies into (_body_buffers.py).
Bytes = bytes | bytearray

# Strings shorter than this are decoded as usual: the placeholder round trip would cost more than it saves.
LONG_STRING = 2048
# Below this body size there is no long string worth the scan.
_MIN_BODY = 16 * 1024
# Raw strings adding up to less than this are copied into the encoded body: a piece of their own would
# cost a socket write each.
_MIN_SPLICED = 64 * 1024

_decode = msgspec.json.Decoder().decode
_decode_str = msgspec.json.Decoder(str).decode
# Checks that a JSON value is well formed without building it.
_check = msgspec.json.Decoder(msgspec.Raw).decode
# A JSON string that decodes to a text no client can send without knowing this process's secret.
_MARK = "\x00epd-raw-" + secrets.token_hex(8) + "-"
_MARK_JSON = msgspec.json.encode(_MARK)[:-1]  # opening quote and escaped mark, no closing quote
_BACKSLASH = 0x5C
_COLON = 0x3A
_WHITESPACE = b" \t\r\n"


def decode(body: Bytes) -> Any:
    """``msgspec.json.decode(body)``, with long unescaped strings as :class:`msgspec.Raw`.

    Raises :class:`msgspec.DecodeError` (or ``RecursionError``) like a plain decode.
    """
    spans = _long_strings(body) if len(body) >= _MIN_BODY else []
    if not spans:
        return _decode(body)
    view = memoryview(body)
    pieces: list[Bytes] = []
    raws: dict[str, msgspec.Raw] = {}
    previous = 0
    for index, (start, end) in enumerate(spans):
        string = view[start : end + 1]
        _check(string)  # a raw control character: the DecodeError a plain decode raises
        pieces.append(body[previous:start])
        pieces.append(b'%s%d"' % (_MARK_JSON, index))
        raws[f"{_MARK}{index}"] = msgspec.Raw(string)
        previous = end + 1
    pieces.append(body[previous:])
    # A long object key is rare; only then must the walk look at keys too.
    keys = any(_is_key(body, end) for _, end in spans)
    return _restore(_decode(b"".join(pieces)), raws, keys)


def _is_key(body: Bytes, end: int) -> bool:
    """Whether the string closed at ``end`` is an object key: a colon follows, after any whitespace."""
    index, size = end + 1, len(body)
    while index < size and body[index] in _WHITESPACE:
        index += 1
    return index < size and body[index] == _COLON


def _long_strings(body: Bytes) -> list[tuple[int, int]]:
    """(opening quote, closing quote) of every long string without escapes, in order.

    Outside strings JSON has no quote, and inside them only escaped ones: so in a valid body the
    unescaped quotes, taken in order, pair up exactly as the strings' delimiters.
    """
    spans: list[tuple[int, int]] = []
    find = body.find
    ascii_body = body.isascii()
    start = find(b'"')
    while start >= 0:
        end = find(b'"', start + 1)
        while end > 0 and body[end - 1] == _BACKSLASH:
            slashes = 1
            while body[end - 1 - slashes] == _BACKSLASH:
                slashes += 1
            if slashes % 2 == 0:
                break  # the backslashes escape each other, not the quote
            end = find(b'"', end + 1)
        if end < 0:
            break  # unterminated: the decode will fail on it anyway
        if (
            end - start > LONG_STRING
            and find(b"\\", start, end) < 0
            and (ascii_body or body[start:end].isascii())
        ):
            spans.append((start, end))
        start = find(b'"', end + 1)
    return spans


def _restore(value: Any, raws: dict[str, msgspec.Raw], keys: bool) -> Any:
    """Put the raw strings back where their placeholders were decoded (iteratively: bodies nest deep)."""
    if isinstance(value, str):
        return raws.get(value, value)
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if keys and any(key.startswith(_MARK) for key in node):  # keys must be text, in order
                items = list(node.items())
                node.clear()
                node.update((text_of(raws[key]) if key in raws else key, item) for key, item in items)
            for key, item in node.items():
                if isinstance(item, str):
                    if item.startswith(_MARK):
                        node[key] = raws.get(item, item)
                elif isinstance(item, (dict, list)):
                    stack.append(item)
        elif isinstance(node, list):
            for index, item in enumerate(node):
                if isinstance(item, str):
                    if item.startswith(_MARK):
                        node[index] = raws.get(item, item)
                elif isinstance(item, (dict, list)):
                    stack.append(item)
    return value


def encode_pieces(value: Any, encode: Callable[[Any], bytes]) -> list[bytes | memoryview]:
    """``encode(value)`` as pieces to send one after the other: the raw strings it holds are not copied
    into one new buffer but referenced where they arrived (views of the received body).

    Encoding a 1.6 MB body of 8 images copies 1.6 MB into a fresh allocation, which glibc serves from
    new pages (the freed buffers of the previous request went back to the system): 1.1 ms a request on
    the perf rig, against the 0.2 ms the copy takes on warm memory.
    """
    raws: list[msgspec.Raw] = []
    try:
        swapped = _swap_raws(value, raws)
    except RecursionError:
        return [encode(value)]
    if sum(map(len, raws)) < _MIN_SPLICED:
        return [encode(value)]
    encoded = encode(swapped)
    pieces: list[bytes | memoryview] = []
    position = 0
    for index, raw in enumerate(raws):
        # Placeholders come out in the order they were put in: both walks follow insertion order.
        token = b'%s%d"' % (_MARK_JSON, index)
        found = encoded.find(token, position)
        if found < 0:  # cannot happen; a plain encoding is still right
            return [encode(value)]
        pieces.append(encoded[position:found])
        pieces.append(memoryview(raw))
        position = found + len(token)
    pieces.append(encoded[position:])
    return pieces


def _swap_raws(value: Any, raws: list[msgspec.Raw]) -> Any:
    """``value`` with each raw string replaced by a placeholder, in encoding order; containers that hold
    none are shared, not copied."""
    if isinstance(value, msgspec.Raw):
        raws.append(value)
        return f"{_MARK}{len(raws) - 1}"
    if isinstance(value, dict):
        count = len(raws)
        swapped = {key: _swap_raws(item, raws) for key, item in value.items()}
        return swapped if len(raws) > count else value
    if isinstance(value, (list, tuple)):
        count = len(raws)
        items = [_swap_raws(item, raws) for item in value]
        return items if len(raws) > count else value
    return value


def raw_text(value: msgspec.Raw) -> memoryview:
    """The UTF-8 bytes of a raw string's text: its bytes without the quotes (it holds no escape)."""
    return memoryview(value)[1:-1]


def text_of(value: Any) -> Any:
    """A raw string as ``str``; anything else as it is. For the few places that need real text."""
    return _decode_str(value) if isinstance(value, msgspec.Raw) else value
