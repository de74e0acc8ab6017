"""How a trajectory row should keep a decoded clip: an animated PNG, H.264 in MP4 with 4:2:0 or
4:4:4 chroma at crf 18 or 0, and lossless H.264 RGB (libx264rgb, crf 0: what pixrl stores,
`pixrl.artifacts.media.clip_bytes`), on clips with smooth motion (a shape moving
over a static gradient; a smooth texture under a camera pan, where every pixel changes) and on
noise (the worst case for any codec). Prints
bytes per frame, encode and decode milliseconds per frame, and the largest pixel error after a
round trip.

    python benchmarks/clip_encoding.py [--frames 33] [--side 256]
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pixrl.artifacts.media import animated_png, clip_bytes, decode_media  # noqa: E402


def moving_shape(frames: int, side: int) -> np.ndarray:
    y, x = np.mgrid[:side, :side] / side
    base = np.stack([x, y, 0.5 * (x + y)], -1) * 200
    clip = np.empty((frames, side, side, 3), np.uint8)
    for f in range(frames):
        cx, cy = 0.2 + 0.6 * f / max(frames - 1, 1), 0.5 + 0.2 * np.sin(f / 4)
        disc = (x - cx) ** 2 + (y - cy) ** 2 < 0.02
        img = base.copy()
        img[disc] = (230, 40, 40)
        clip[f] = img.astype(np.uint8)
    return clip


def panning_texture(frames: int, side: int, seed: int = 0) -> np.ndarray:
    """A smooth texture under a camera pan (2 px per frame): every pixel changes every frame, as in
    most generated video."""
    rng = np.random.default_rng(seed)
    coarse = rng.random((side // 8 + 1, (side + 2 * frames) // 8 + 1, 3))
    tex = np.kron(coarse, np.ones((8, 8, 1)))  # blocks, then a box blur: smooth, natural-ish content
    for axis in (0, 1):
        tex = sum(np.roll(tex, s, axis=axis) for s in range(-4, 4)) / 8
    tex = (tex * 255).astype(np.uint8)
    return np.stack([tex[:side, 2 * f:2 * f + side] for f in range(frames)])


def mp4(clip: np.ndarray, codec: str, pix_fmt: str, crf: int) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream(codec, rate=16)
        stream.width, stream.height, stream.pix_fmt = clip.shape[2], clip.shape[1], pix_fmt
        stream.options = {"crf": str(crf)}
        for f in clip:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


ENCODINGS = {
    "APNG (level 6)": animated_png,
    "H.264 4:2:0 crf 18": lambda c: mp4(c, "libx264", "yuv420p", 18),
    "H.264 4:4:4 crf 0": lambda c: mp4(c, "libx264", "yuv444p", 0),
    "H.264 RGB crf 0 (stored)": clip_bytes,
}


def measure(name: str, clip: np.ndarray) -> None:
    f = len(clip)
    for label, encode in ENCODINGS.items():
        t0 = time.perf_counter()
        data = encode(clip)
        enc = time.perf_counter() - t0
        t0 = time.perf_counter()
        back = decode_media(data)
        dec = time.perf_counter() - t0
        err = np.abs(back.astype(int) - clip.astype(int)) if back.shape == clip.shape else None
        errs = f"{err.max()} / {err.mean():.2f}" if err is not None else f"frames {len(back)} ≠ {f}"
        print(f"| {name} | {label} | {len(data) / f / 1024:.1f} | {1000 * enc / f:.1f} | {1000 * dec / f:.1f} | "
              f"{errs} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=33)
    ap.add_argument("--side", type=int, default=256)
    a = ap.parse_args()
    print(f"{a.frames} frames of {a.side}², 16 fps\n\n| clip | encoding | KiB/frame | encode ms/frame | "
          "decode ms/frame | pixel error max / mean |\n|---|---|---|---|---|---|")
    measure("moving shape", moving_shape(a.frames, a.side))
    measure("panning texture", panning_texture(a.frames, a.side))
    rng = np.random.default_rng(0)
    measure("noise", rng.integers(0, 256, (a.frames, a.side, a.side, 3), dtype=np.uint8))


if __name__ == "__main__":
    main()
