"""A dependency-free PNG bar chart: one group of bars per model, one colour per route.

Example: ``write_bars("chart.png", {"llama-64": [1.0, 1.2]}, ["xla_tp", "hand"], cap=4.0)``.
Colours are listed in the markdown legend; bar heights are capped at ``cap``.
"""
from __future__ import annotations

import struct
import zlib

COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


def _png(path: str, pixels: list[bytearray], width: int, height: int) -> None:
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))


def write_bars(path: str, groups: dict[str, list], routes: list[str], cap: float = 4.0,
               bar: int = 6, height: int = 240) -> None:
    """Grouped bars (None = missing); a grey line marks 1.0, the optimum."""
    width = len(groups) * (len(routes) * bar + 8) + 8
    pixels = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]
    one = height - 1 - int((height - 10) / cap)
    for x in range(width):
        pixels[one][3 * x:3 * x + 3] = bytes((160, 160, 160))
    x = 8
    for values in groups.values():
        for i, value in enumerate(values):
            if value is not None:
                top = height - 1 - int((height - 10) * min(float(value), cap) / cap)
                for y in range(top, height):
                    for dx in range(bar - 1):
                        pixels[y][3 * (x + dx):3 * (x + dx) + 3] = bytes(COLOURS[i % len(COLOURS)])
            x += bar
        x += 8
    _png(path, pixels, width, height)
