"""The shapes world's vocabulary and scene geometry.

Learnability drives every constant here (see docs/miniature.md): a coarse 2×2 placement
grid, few and large flat shapes, four saturated colours on white. The feasibility study
found that free positions and small random sizes left a CPU-pretrained model blobby.
"""

from __future__ import annotations

from dataclasses import dataclass

IMAGE_SIZE = 32
GRID = 2
CELL_CENTERS = (8.0, 24.0)  # pixel centres of the grid rows/columns
SIZES = (10, 11, 12)  # side / diameter / base of a shape, in pixels
JITTER = 1  # ± pixels of position jitter around the cell centre

BACKGROUND = (255, 255, 255)
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
}
SHAPES = ("circle", "square", "triangle")
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}
RELATIONS = ("left of", "right of", "above", "below")


@dataclass(frozen=True)
class PlacedShape:
    """One flat shape: colour, kind, grid cell (row, col), pixel size and jitter."""

    color: str
    shape: str
    row: int
    col: int
    size: int = 11
    dx: int = 0
    dy: int = 0

    @property
    def center(self) -> tuple[float, float]:
        """(x, y) pixel centre."""
        return CELL_CENTERS[self.col] + self.dx, CELL_CENTERS[self.row] + self.dy
