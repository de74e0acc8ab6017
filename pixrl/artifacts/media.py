"""Sample grids for MLflow: one row per prompt group, one column per group member."""

from __future__ import annotations

import numpy as np


def image_grid(images: np.ndarray, cols: int, pad: int = 2, scale: int = 1) -> np.ndarray:
    """uint8 [N, H, W, 3] → one uint8 grid image, padded in white, optionally upscaled."""
    n, h, w, c = images.shape
    rows = (n + cols - 1) // cols
    grid = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, c), 255, np.uint8)
    for i, im in enumerate(images):
        r, q = divmod(i, cols)
        grid[pad + r * (h + pad): pad + r * (h + pad) + h, pad + q * (w + pad): pad + q * (w + pad) + w] = im
    if scale > 1:
        grid = grid.repeat(scale, 0).repeat(scale, 1)
    return grid


def png_bytes(image: np.ndarray, compress_level: int = 6) -> bytes:
    """uint8 [H, W, 3] → PNG (lossless: the scored pixels are the stored pixels). Level 1 encodes
    an upscaled sample grid 4× faster than the default 6 for 25% more bytes."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=compress_level)
    return buf.getvalue()


def clip_bytes(frames: np.ndarray, fps: int = 16) -> bytes:
    """uint8 clip [F, H, W, 3] → MP4 holding lossless H.264 in RGB (libx264rgb, crf 0): the stored
    frames are bit-for-bit the scored frames, as PNG is for images, at a fraction of an animated
    PNG's size on moving content — 5.4 against 108 KiB per 256² frame under a camera pan
    (benchmarks/clip_encoding.py). Any ffmpeg-based decoder reads it (PyAV, ffmpeg, OpenCV);
    browsers do not play 4:4:4 H.264, hence the row's PNG poster and the animated-PNG sample grid."""
    import io

    import av

    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"a clip is uint8 [F, H, W, 3]; got {frames.dtype} {frames.shape}")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264rgb", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "rgb24"
        stream.options = {"crf": "0", "preset": "fast"}
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def clip_rate(data: bytes) -> float | None:
    """The frame rate an MP4 plays at (its video stream's average rate), None for other media."""
    if data[4:8] != b"ftyp":
        return None
    import io

    import av

    with av.open(io.BytesIO(data)) as inp:
        rate = inp.streams.video[0].average_rate
    return float(rate) if rate else None


def animated_png(frames: np.ndarray, fps: int = 16, compress_level: int = 6) -> bytes:
    """uint8 frames [F, H, W, 3] → one animated PNG (APNG), which browsers and MLflow's artifact
    view play (the sample grid of a video run). The APNG writer stores only each frame's changed
    region and folds a repeated frame into the previous one's duration (a still clip becomes a
    plain PNG); the frame time and count are kept in text chunks, so `decode_media` unfolds them
    and gives back exactly F frames."""
    import io

    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"animated frames are uint8 [F, H, W, 3]; got {frames.dtype} {frames.shape}")
    ms = max(1, round(1000 / fps))
    info = PngInfo()
    info.add_text(_FRAME_MS, str(ms))
    info.add_text(_FRAMES, str(len(frames)))
    imgs = [Image.fromarray(f) for f in frames]
    buf = io.BytesIO()
    imgs[0].save(buf, format="PNG", save_all=True, append_images=imgs[1:], duration=ms, loop=0, pnginfo=info,
                 compress_level=compress_level)
    return buf.getvalue()


_FRAME_MS, _FRAMES = "pixrl:frame_ms", "pixrl:frames"


def decode_media(data: bytes) -> np.ndarray:
    """A stored image (PNG → [H, W, 3]), clip (MP4 → [F, H, W, 3]) or animated PNG (→ [F, H, W, 3],
    folded repeats unfolded)."""
    import io

    if data[4:8] == b"ftyp":  # an MP4 (ISO base media) file
        import av

        with av.open(io.BytesIO(data)) as inp:
            return np.stack([f.to_ndarray(format="rgb24") for f in inp.decode(video=0)])
    from PIL import Image, ImageSequence

    im = Image.open(io.BytesIO(data))
    count = int(im.info.get(_FRAMES, 0))
    if not count and not getattr(im, "is_animated", False):
        return np.asarray(im.convert("RGB"))  # an image
    ms = float(im.info.get(_FRAME_MS, 0)) or None
    frames = []
    for f in ImageSequence.Iterator(im):
        rgb = np.asarray(f.convert("RGB"))
        repeat = max(1, round(f.info.get("duration", ms) / ms)) if ms and count else 1
        frames.extend([rgb] * repeat)
    if count and len(frames) == 1:
        frames *= count  # a still clip, written as one frame
    if count and len(frames) != count:
        raise ValueError(f"stored animation decodes to {len(frames)} frames, its header says {count}; it is corrupt")
    return np.stack(frames)


def media_bytes(sample: np.ndarray) -> bytes:
    """What a trajectory row stores for one decoded sample: PNG for an image, lossless MP4 for a clip."""
    return png_bytes(sample) if sample.ndim == 3 else clip_bytes(sample)


def clip_grid(clips: np.ndarray, cols: int, pad: int = 2, scale: int = 1) -> np.ndarray:
    """uint8 clips [N, F, H, W, 3] → one animated grid [F, GH, GW, 3] (frame f of every clip side by side)."""
    return np.stack([image_grid(clips[:, f], cols, pad, scale) for f in range(clips.shape[1])])


def wav_bytes(wave: np.ndarray, rate: int) -> bytes:
    """float waveform [channels, samples] in [-1, 1] → a 16-bit PCM WAV (what every player
    reads); samples beyond ±1 are clipped, as any 16-bit export clips them."""
    import io
    import wave as wavefile

    if wave.ndim != 2 or not np.isfinite(wave).all():
        raise ValueError(f"a soundtrack is a finite float waveform [channels, samples]; got {wave.dtype} {wave.shape}")
    pcm = (np.clip(wave, -1.0, 1.0) * 32767).round().astype("<i2").T  # interleaved frames
    buf = io.BytesIO()
    with wavefile.open(buf, "wb") as out:
        out.setnchannels(wave.shape[0])
        out.setsampwidth(2)
        out.setframerate(int(rate))
        out.writeframes(pcm.tobytes())
    return buf.getvalue()


def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """A 16-bit PCM WAV (what `wav_bytes` writes) → (float32 waveform [channels, samples] in
    [-1, 1], sample rate)."""
    import io
    import wave as wavefile

    with wavefile.open(io.BytesIO(data), "rb") as inp:
        if inp.getsampwidth() != 2:
            raise ValueError(f"a soundtrack is 16-bit PCM WAV; this one has {8 * inp.getsampwidth()}-bit samples")
        channels, rate = inp.getnchannels(), inp.getframerate()
        pcm = np.frombuffer(inp.readframes(inp.getnframes()), "<i2")
    return (pcm.reshape(-1, channels).T / 32767.0).astype(np.float32), rate
