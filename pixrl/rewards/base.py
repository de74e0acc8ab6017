"""The scoring contract every reward implements, and the registry that names them.

A reward scores uint8 images [B, H, W, 3] with their prompts and prompt metadata and returns
float32 arrays of length B: its main value under its own name, optionally diagnostics under
"<name>.<key>". It declares its range, direction and device needs. Nothing is ever zeroed:
NaN, a missing key or a wrong length is a ScoringError naming the sample and the scorer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import numpy as np


class ScoringError(RuntimeError):
    """A scorer produced no usable score for some sample."""


class Reward(ABC):
    name: str = ""
    value_range: tuple[float, float] = (-np.inf, np.inf)
    higher_is_better: bool = True
    device: str = "cpu"

    @abstractmethod
    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict]) -> dict[str, np.ndarray]:
        ...


_REWARDS: dict[str, Callable[..., Reward]] = {}


def register_reward(name: str):
    def deco(cls):
        cls.name = name
        _REWARDS[name] = cls
        return cls

    return deco


def registered_rewards() -> list[str]:
    _import_builtin()
    return sorted(_REWARDS)


def build_reward(name: str, **options) -> Reward:
    _import_builtin()
    if name not in _REWARDS:
        raise KeyError(f"unknown reward {name!r}; registered rewards: {', '.join(sorted(_REWARDS))}")
    try:
        return _REWARDS[name](**options)
    except TypeError as exc:
        raise ValueError(f"bad options for reward {name!r}: {exc}") from None


def _import_builtin() -> None:
    from . import jpeg, shapes  # noqa: F401
