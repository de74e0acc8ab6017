"""A clip read as Qwen-VL's video input, the way qwen-vl-utils reads a video file and Qwen2-VL's
processor patches it — without torchvision, which both use:
- frames picked uniformly at a target rate (`smart_nframes`: total / clip fps · fps, kept within
  [4, 768] and rounded to the 2-frame temporal patch; indices linspace(0, n − 1).round());
- each frame resized on the 28-pixel grid within [min_pixels, max_pixels] (`smart_resize`) by
  antialiased bicubic on uint8 pixels — torchvision's CPU resize, torch's native uint8 kernel;
- the frames rescaled to [0, 1], normalised, and cut into 2-frame × 14² patches ordered by 2×2
  merge window ([grid_t·grid_h·grid_w, C·2·14·14], as the vision tower's Conv3d reads them).
Used by the VideoAlign reward (rewards/videoalign.py)."""

from __future__ import annotations

import math

import numpy as np
import torch

FRAME_FACTOR = 2  # frames per temporal patch
FPS_MIN_FRAMES, FPS_MAX_FRAMES = 4, 768
VIDEO_MIN_PIXELS = 128 * 28 * 28


def smart_nframes(total: int, clip_fps: float, fps: float | None = None, nframes: int | None = None) -> int:
    """How many frames qwen-vl-utils reads from a `total`-frame clip: `nframes` rounded to the
    temporal patch, or `fps` frames a second of the clip's `clip_fps`."""
    if (fps is None) == (nframes is None):
        raise ValueError("give the sampling rate (fps) or the frame count (nframes), one of them")
    if nframes is not None:
        n = round(nframes / FRAME_FACTOR) * FRAME_FACTOR
    else:
        low = math.ceil(FPS_MIN_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
        high = math.floor(min(FPS_MAX_FRAMES, total) / FRAME_FACTOR) * FRAME_FACTOR
        n = round(min(max(total / clip_fps * fps, low), high) / FRAME_FACTOR) * FRAME_FACTOR
    n = min(n, total)
    if not FRAME_FACTOR <= n <= total:
        raise ValueError(f"a {total}-frame clip yields {n} frames to read; a Qwen-VL video needs "
                         f"between {FRAME_FACTOR} and {total}")
    return n


def frame_indices(total: int, n: int) -> list[int]:
    """The uniform pick: linspace(0, total − 1, n) rounded."""
    return torch.linspace(0, total - 1, n).round().long().tolist()


def smart_resize(height: int, width: int, min_pixels: int, max_pixels: int, factor: int = 28) -> tuple[int, int]:
    """qwen-vl-utils' frame size: each side on the `factor` grid (at least one cell), the area
    brought within [min_pixels, max_pixels] at the aspect ratio. (transformers' image-processor
    version differs for sides under half a cell.)"""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a {height}×{width} frame is too elongated for Qwen-VL (aspect ratio over 200)")
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def resized_frames(frames: np.ndarray, min_pixels: int, max_pixels: int) -> torch.Tensor:
    """[T, 3, H', W'] float (values 0–255, whole numbers) from uint8 [T, H, W, 3]: bicubic with
    antialiasing to Qwen-VL's `smart_resize` size, on uint8 as torchvision resizes on a CPU."""
    video = torch.from_numpy(np.array(frames, dtype=np.uint8)).permute(0, 3, 1, 2).contiguous()
    h, w = video.shape[-2:]
    size = smart_resize(h, w, min_pixels, max_pixels)
    if tuple(size) != (h, w):
        video = torch.nn.functional.interpolate(video, size=list(size), mode="bicubic", align_corners=False,
                                                antialias=True)
    return video.float()


def video_patches(video: torch.Tensor, mean, std, patch: int = 14, merge: int = 2,
                  temporal: int = FRAME_FACTOR) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values_videos [grid_t·grid_h·grid_w, C·temporal·patch²], grid_thw [3]) of one video
    [T, C, H, W] in 0–255: rescaled, normalised by the image processor's mean/std, its frames in
    temporal pairs (the last repeated when T is odd), patches in merge-window order."""
    x = video.float() / 255.0
    x = (x - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)
    if pad := -x.shape[0] % temporal:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    t, c, h, w = x.shape
    gt, gh, gw = t // temporal, h // patch, w // patch
    x = x.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, C, temporal, p, p]
    return x.reshape(gt * gh * gw, c * temporal * patch * patch), torch.tensor([gt, gh, gw])
