"""The soak's fake encoder (benchmarks/soak.py): tests/load/fake_encoder_server.py's encoder, whose
behaviour follows a schedule instead of a fixed mode.

    python -m tests.load.soak_encoder PORT [--host ADDRESS] [--storage DIR]
                                           [--schedule MODE:SECONDS,...] [--offset SECONDS]
                                           [--slow-ms MS] [--marker-ms MS]

``--schedule`` cycles through its modes, each for its seconds, from ``--offset`` seconds into the cycle
(default: ``ok`` for ever): ``ok`` answers correctly, ``slow`` answers correctly after ``--slow-ms``
(default 300) per call, and every fault of fake_encoder_server (``refuse``, ``500``, ``hang``,
``garbage``, ``drop``) misbehaves as it does there. An image whose base64 starts with the bytes ``SLOW``
(``U0xPV`` in base64) is answered after ``--marker-ms`` (default 400): the load generator's requests that
it cuts during their encode stage carry one, so that the cut lands while the middleware waits for the
encoder, whatever the other requests' pace. Standard library only, as the encoder it extends.
"""

from __future__ import annotations

import asyncio  # noqa: TID251 (extends the stdlib fake encoder, as it is written)
import sys
import time

from tests.load.fake_encoder_server import FAULTS, Encoder

MODES = ("ok", "slow", *FAULTS)
# base64 of b"SLOW" as the first bytes of an image's payload
MARKER = "base64,U0xPV"


def parse_schedule(text: str) -> list[tuple[str, float]]:
    schedule = []
    for entry in text.split(","):
        mode, _, seconds = entry.partition(":")
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
        schedule.append((mode, float(seconds)))
    return schedule


class ScheduledEncoder(Encoder):
    def __init__(
        self,
        port: int,
        host: str,
        storage: str | None,
        schedule: list[tuple[str, float]],
        offset: float,
        slow_s: float,
        marker_s: float,
    ) -> None:
        super().__init__(port, None, host, storage)
        self.schedule = schedule
        self.cycle = sum(seconds for _, seconds in schedule)
        self.origin = time.monotonic() - offset
        self.slow_s = slow_s
        self.marker_s = marker_s

    def scheduled(self) -> str:
        if len(self.schedule) == 1:
            return self.schedule[0][0]
        at = (time.monotonic() - self.origin) % self.cycle
        for mode, seconds in self.schedule:
            if at < seconds:
                return mode
            at -= seconds
        return self.schedule[-1][0]

    def mode(self) -> str:
        mode = self.scheduled()
        # A slow encoder answers correctly, late: the base class's per-call time, set while it lasts.
        self.call_s = self.slow_s if mode == "slow" else 0.0
        return "ok" if mode == "slow" else mode

    async def encode(self, request: dict, size: int) -> None:
        await super().encode(request, size)
        parts = request["messages"][0]["content"]
        if any(MARKER in (part.get("image_url") or {}).get("url", "")[:64] for part in parts):
            await asyncio.sleep(self.marker_s)


if __name__ == "__main__":
    port = int(sys.argv[1])
    options = dict(zip(sys.argv[2::2], sys.argv[3::2], strict=True))
    encoder = ScheduledEncoder(
        port,
        options.get("--host", "127.0.0.1"),
        options.get("--storage"),
        parse_schedule(options.get("--schedule", "ok:1")),
        float(options.get("--offset", "0")),
        float(options.get("--slow-ms", "300")) / 1000,
        float(options.get("--marker-ms", "400")) / 1000,
    )
    asyncio.run(encoder.run())
