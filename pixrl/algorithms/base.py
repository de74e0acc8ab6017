"""What an RL algorithm provides to the loop, and the registry that names algorithms.

The engine never branches on algorithm names: it asks the algorithm which trajectory fields it
needs stored, for advantages from rewards and groups, and for the loss of one replayed
transition. A new GRPO-family algorithm is one module here + one preset + its tests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from ..config.registry import Registry
from ..config.schema import AlgorithmConfig
from .advantages import GroupAdvantages
from .flow_sde import StepOut


class Algorithm(ABC):
    name: str = ""
    #: trajectory fields the update reads back from the store
    needs: frozenset[str] = frozenset()

    def __init__(self, cfg: AlgorithmConfig):
        self.cfg = cfg

    @property
    def needs_reference(self) -> bool:
        """Whether transition_loss wants the reference policy's step (e.g. KL with β > 0)."""
        return False

    @abstractmethod
    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages: ...

    @abstractmethod
    def transition_loss(self, new: StepOut, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                        reference: StepOut | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


def _builtin() -> None:
    from . import flow_grpo  # noqa: F401  (registers the built-in algorithms)


ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm", "algorithms", _builtin)
register_algorithm = ALGORITHMS.register


def build_algorithm(cfg: AlgorithmConfig) -> Algorithm:
    return ALGORITHMS.get(cfg.name)(cfg)
