"""How a trajectory row should keep a decoded clip: lossless APNG (what pixrl stores) against
H.264 in MP4 (PyAV, if installed: `pip install av`), on clips with smooth motion (a shape moving
over a gradient, like a generated video) and on noise (the worst case for any codec). Prints
bytes per frame, encode and decode milliseconds per frame, and the largest pixel error after a
round trip — the reward scores the decoded frames, so a lossy store means the stored clip is not
the scored clip.

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

from pixrl.artifacts.media import clip_bytes, decode_media  # noqa: E402


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


def mp4_round_trip(clip: np.ndarray, crf: int) -> tuple[bytes, np.ndarray, float, float]:
    import av

    t0 = time.perf_counter()
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=16)
        stream.width, stream.height, stream.pix_fmt = clip.shape[2], clip.shape[1], "yuv420p"
        stream.options = {"crf": str(crf)}
        for f in clip:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())
    enc = time.perf_counter() - t0
    data = buf.getvalue()
    t0 = time.perf_counter()
    with av.open(io.BytesIO(data)) as inp:
        back = np.stack([fr.to_ndarray(format="rgb24") for fr in inp.decode(video=0)])
    return data, back, enc, time.perf_counter() - t0


def measure(name: str, clip: np.ndarray) -> None:
    f = len(clip)
    for level in (1, 6):
        t0 = time.perf_counter()
        data = clip_bytes(clip, compress_level=level)
        enc = time.perf_counter() - t0
        t0 = time.perf_counter()
        back = decode_media(data)
        dec = time.perf_counter() - t0
        err = int(np.abs(back.astype(int) - clip.astype(int)).max())
        print(f"| {name} | APNG level {level} | {len(data) / f / 1024:.1f} | {1000 * enc / f:.1f} | "
              f"{1000 * dec / f:.1f} | {err} |")
    try:
        import av  # noqa: F401
    except ImportError:
        print(f"| {name} | MP4 (H.264) | PyAV not installed (`pip install av`) | | | |")
        return
    for crf in (0, 18):
        data, back, enc, dec = mp4_round_trip(clip, crf)
        err = int(np.abs(back.astype(int) - clip.astype(int)).max()) if back.shape == clip.shape else -1
        print(f"| {name} | MP4 H.264 crf {crf} (yuv420p) | {len(data) / f / 1024:.1f} | {1000 * enc / f:.1f} | "
              f"{1000 * dec / f:.1f} | {err} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=33)
    ap.add_argument("--side", type=int, default=256)
    a = ap.parse_args()
    print(f"{a.frames} frames of {a.side}², 16 fps\n\n| clip | encoding | KiB/frame | encode ms/frame | "
          "decode ms/frame | max pixel error |\n|---|---|---|---|---|---|")
    measure("moving shape", moving_shape(a.frames, a.side))
    rng = np.random.default_rng(0)
    measure("noise", rng.integers(0, 256, (a.frames, a.side, a.side, 3), dtype=np.uint8))


if __name__ == "__main__":
    main()
