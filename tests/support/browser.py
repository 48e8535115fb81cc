"""Headless Chromium (Debian's `chromium` package, `make test-tools`) for tests of HTML pages, and a PNG reader."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from collections import Counter
from pathlib import Path

import pytest

TIMEOUT_S = 30


def chromium() -> str:
    """The browser's path; the test skips, saying why, where it is not installed."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("headless Chromium not found: `make test-tools` installs Debian's chromium package")


def run(url: str, work: Path, *args: str) -> str:
    """Run headless Chromium on `url` with `args` (a fresh profile under `work`); its stdout."""
    cmd = [chromium(), "--headless", "--no-sandbox",  # no sandbox: tests run as root in containers
           "--disable-gpu", "--no-first-run", "--disable-extensions", "--disable-background-networking",
           f"--user-data-dir={work / 'chromium-profile'}", *args, url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert done.returncode == 0, f"chromium exited {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


def dump_dom(url: str, work: Path) -> str:
    """The page's DOM after it loaded, serialized."""
    return run(url, work, "--dump-dom")


def screenshot(url: str, work: Path, path: Path, width: int, height: int) -> None:
    run(url, work, f"--screenshot={path}", f"--window-size={width},{height}", "--hide-scrollbars")
    assert path.exists(), f"chromium wrote no screenshot at {path}"


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, one bytes object per pixel) of an 8-bit RGB or RGBA PNG (what Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width, height, channels = 8, b"", 0, 0, 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", chunk[:10])
            assert depth == 8 and color in (2, 6), f"unexpected PNG format: depth {depth}, color type {color}"
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw, stride = zlib.decompress(idat), width * channels
    rows: list[bytearray] = []
    prev = bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(line)
        prev = line
    return width, height, [bytes(r[x:x + channels]) for r in rows for x in range(0, stride, channels)]


def ink(pixels: list[bytes]) -> tuple[float, int]:
    """(share of pixels not of the most common colour, number of distinct colours): how much is drawn."""
    counts = Counter(pixels)
    return 1 - counts.most_common(1)[0][1] / len(pixels), len(counts)
