"""Deterministic numpy renderer for shapes scenes, and scene sampling from prompt metadata."""

from __future__ import annotations

import numpy as np

from .scene import BACKGROUND, COLORS, GRID, IMAGE_SIZE, JITTER, SHAPES, SIZES, PlacedShape

_YY, _XX = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE].astype(np.float32) + 0.5  # pixel centres


def shape_mask(shape: str, cx: float, cy: float, size: float, height: int = IMAGE_SIZE,
               width: int = IMAGE_SIZE) -> np.ndarray:
    """Boolean mask of one flat shape whose bounding box is `size` wide, centred at (cx, cy).

    Also used by the judge as the ideal template a detected component is compared with.
    """
    yy, xx = (_YY, _XX) if (height, width) == (IMAGE_SIZE, IMAGE_SIZE) else (
        np.mgrid[0:height, 0:width].astype(np.float32) + 0.5)
    half = size / 2.0
    if shape == "square":
        return (np.abs(xx - cx) <= half) & (np.abs(yy - cy) <= half)
    if shape == "circle":
        return (xx - cx) ** 2 + (yy - cy) ** 2 <= half**2
    if shape == "triangle":  # upright: apex at the top, base at the bottom
        top, bottom = cy - half, cy + half
        frac = (yy - top) / size
        return (yy >= top) & (yy <= bottom) & (np.abs(xx - cx) <= frac * half + 0.25)
    raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")


def render(objects: list[PlacedShape]) -> np.ndarray:
    """uint8 [H, W, 3] image of the given shapes on the plain background (later ones on top)."""
    img = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    img[:] = BACKGROUND
    for obj in objects:
        cx, cy = obj.center
        img[shape_mask(obj.shape, cx, cy, obj.size)] = COLORS[obj.color]
    return img


def _free_cells(rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
    cells = [(r, c) for r in range(GRID) for c in range(GRID)]
    order = rng.permutation(len(cells))[:n]
    return [cells[i] for i in order]


def _relation_cells(rng: np.random.Generator, relation: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """Cells (first, second) so that first is `relation` second, in one row or one column."""
    while True:
        a = (int(rng.integers(GRID)), int(rng.integers(GRID)))
        b = (int(rng.integers(GRID)), int(rng.integers(GRID)))
        if relation == "left of" and a[1] < b[1]:
            return a, b
        if relation == "right of" and a[1] > b[1]:
            return a, b
        if relation == "above" and a[0] < b[0]:
            return a, b
        if relation == "below" and a[0] > b[0]:
            return a, b


def sample_scene(meta: dict, rng: np.random.Generator) -> list[PlacedShape]:
    """A random scene that satisfies the prompt metadata; unspecified colours are drawn at random.

    `meta` is the structured form stored beside every prompt:
    {"category", "objects": [{"shape", "color" | None, "count"}], "relation": str | None}.
    """
    specs: list[tuple[str, str]] = []
    for obj in meta["objects"]:
        for _ in range(int(obj["count"])):
            color = obj.get("color") or str(rng.choice(list(COLORS)))
            specs.append((color, obj["shape"]))
    if meta.get("relation"):
        cells = list(_relation_cells(rng, meta["relation"]))
    else:
        cells = _free_cells(rng, len(specs))
    size = int(rng.choice(SIZES))
    out = []
    for (color, shape), (row, col) in zip(specs, cells):
        dx, dy = (int(v) for v in rng.integers(-JITTER, JITTER + 1, size=2))
        out.append(PlacedShape(color, shape, row, col, size, dx, dy))
    return out


def render_prompt(meta: dict, seed: int) -> np.ndarray:
    """Render one random scene for a prompt's metadata, deterministically from `seed`."""
    return render(sample_scene(meta, np.random.default_rng(seed)))
