"""Test media built offline: a short video clip (mp4, with OpenCV, which vLLM's own video loader uses, so
run this with the vLLM python) and a short tone (wav, standard library only).

    python -m epd_lab.media video OUT.mp4 [FRAMES] [FPS]
    python -m epd_lab.media audio OUT.wav [SECONDS] [HZ]

Both are deterministic: the same arguments give the same bytes, so their content uuids are stable.
"""

from __future__ import annotations

import base64
import math
import struct
import sys
import wave
from pathlib import Path

__all__ = ["audio_wav", "data_url", "video_mp4"]

WIDTH, HEIGHT = 320, 240


def video_mp4(out: Path, frames: int = 16, fps: int = 4) -> Path:
    """A 320x240 clip of coloured squares moving across a white canvas (needs cv2 and numpy)."""
    import cv2  # only in the vLLM environment
    import numpy as np

    writer = cv2.VideoWriter(str(out), cv2.VideoWriter_fourcc(*"mp4v"), fps, (WIDTH, HEIGHT))
    if not writer.isOpened():
        raise RuntimeError("OpenCV cannot write mp4 here")
    colours = [(0, 0, 255), (0, 200, 0), (255, 0, 0), (0, 200, 255)]
    for index in range(frames):
        frame = np.full((HEIGHT, WIDTH, 3), 255, dtype=np.uint8)
        for square, colour in enumerate(colours):
            x = (20 + square * 70 + index * 9) % (WIDTH - 50)
            y = 40 + square * 40
            frame[y : y + 40, x : x + 40] = colour
        writer.write(frame)
    writer.release()
    return out


def audio_wav(out: Path, seconds: float = 2.0, hz: int = 440, rate: int = 16000) -> Path:
    """A mono 16-bit wav at 16 kHz (what speech models take): a tone whose pitch rises."""
    samples = int(seconds * rate)
    with wave.open(str(out), "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(rate)
        frames = bytearray()
        for n in range(samples):
            pitch = hz * (1 + n / samples)
            frames += struct.pack("<h", int(12000 * math.sin(2 * math.pi * pitch * n / rate)))
        file.writeframes(bytes(frames))
    return out


def data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


if __name__ == "__main__":
    kind, out, *rest = sys.argv[1:]
    if kind == "video":
        print(video_mp4(Path(out), *(int(value) for value in rest)))
    elif kind == "audio":
        print(
            audio_wav(Path(out), *(float(value) for value in rest[:1]), *(int(value) for value in rest[1:]))
        )
    else:
        sys.exit(__doc__)
