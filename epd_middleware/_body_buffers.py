"""Large request bodies read into buffers that are used again, request after request.

A multimodal body arrives from the ASGI server in pieces of up to 256 KB and must be one buffer to be
parsed: 8 images are 1.6 MB. Joined into a new ``bytes`` each time, that buffer comes from memory glibc
has just handed back to the system (a freed multi-MB block is trimmed or unmapped), and every 4 KB page
of it is faulted in again, zeroed, on the first write: 2.4 us a page on the perf rig's machine, about
1 ms for 1.6 MB, more than the copy itself (measured: 717 page faults per 8-image request in the engine
process at concurrency 1, 347 with these buffers, none once malloc keeps freed memory too: _allocator.py,
docs/performance.md). A buffer kept from one request to the next has its pages already.

A buffer is used again only when nothing can still read it: the media strings of a parsed body are
``msgspec.Raw`` views of it, and they can outlive the request (the equivalence probe keeps a sample of
requests, a send may still hold a piece). A ``bytearray`` cannot change size while any view of it
exists, and a view is the only way code keeps reading it (the buffer itself never leaves the exchange;
the engine app is given ``bytes``): so a buffer goes back to the pool only when a change of size
succeeds, else it is left to the views that hold it and freed with them.
"""

from __future__ import annotations

__all__ = ["BodyBuffers", "Filling"]

# Below this, a body is joined as before: a fresh small block costs no more than finding a buffer.
MIN_SIZE = 64 * 1024


class Filling:
    """One body being read into a buffer of the pool: ``add`` each piece, then ``body``."""

    __slots__ = ("_buffer", "_size")

    def __init__(self, buffer: bytearray) -> None:
        self._buffer = buffer
        self._size = 0

    def add(self, piece: bytes) -> None:
        buffer, start = self._buffer, self._size
        end = start + len(piece)
        room = len(buffer) - start
        if end <= len(buffer):
            buffer[start:end] = piece  # same length: a copy, no resize
        elif room > 0:
            view = memoryview(piece)
            buffer[start:] = view[:room]
            buffer += view[room:]  # within the allocation when the buffer had room: no new block
        else:
            buffer += piece
        self._size = end

    def body(self) -> bytearray:
        """The body read: the buffer cut to its length (within its allocation: nothing moves)."""
        if len(self._buffer) > self._size:
            del self._buffer[self._size :]
        return self._buffer


class BodyBuffers:
    """The pool: at most ``max_buffers`` buffers holding at most ``max_bytes`` in all, kept between
    requests. Shared by every request of a middleware; used only from its event loop thread."""

    __slots__ = ("_free", "_held", "max_buffers", "max_bytes")

    def __init__(self, max_buffers: int = 16, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.max_buffers = max_buffers
        self.max_bytes = max_bytes
        self._free: list[bytearray] = []
        self._held = 0  # bytes allocated by the buffers in _free

    def __len__(self) -> int:
        return len(self._free)

    @property
    def held_bytes(self) -> int:
        return self._held

    def filling(self, size: int) -> Filling | None:
        """A buffer for a body of ``size`` bytes (its declared Content-Length), or None where the body is
        too small for one to pay, or too large to keep."""
        if size < MIN_SIZE or size > self.max_bytes:
            return None
        return Filling(self._take(size))

    def _take(self, size: int) -> bytearray:
        # The smallest free buffer whose allocation holds the body without a new block, and which the
        # body fills at least half of: cut to a length under half its allocation, a bytearray reallocates.
        best: int | None = None
        for index, buffer in enumerate(self._free):
            allocated = buffer.__alloc__()
            if size < allocated <= 2 * size and (best is None or allocated < self._free[best].__alloc__()):
                best = index
        if best is None:
            return bytearray(size)
        buffer = self._free.pop(best)
        self._held -= buffer.__alloc__()
        return buffer

    def give_back(self, buffer: bytearray) -> None:
        """Keep ``buffer`` for another body unless a view of it may still be read, or the pool is full."""
        try:
            buffer.append(0)  # raises BufferError while any view of it lives
        except BufferError:
            return
        buffer.pop()
        allocated = buffer.__alloc__()
        if len(self._free) >= self.max_buffers or self._held + allocated > self.max_bytes:
            return
        self._free.append(buffer)
        self._held += allocated
