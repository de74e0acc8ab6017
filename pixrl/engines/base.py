"""What every engine shares: the run's spec and config, its MLflow tracker, the torch thread
count, and a policy loaded on first use (so a stage that finds its output stored loads nothing)."""

from __future__ import annotations

import torch

from ..artifacts.tracking import Tracker
from .policy import TrainablePolicy


class EngineBase:
    def __init__(self, spec):
        self.spec = spec
        self.cfg = spec.cfg
        self.tracker = Tracker(spec.tracking_uri)
        self._policy: TrainablePolicy | None = None
        if self.cfg.run.threads:
            torch.set_num_threads(self.cfg.run.threads)

    @property
    def policy(self) -> TrainablePolicy:
        if self._policy is None:
            self._policy = TrainablePolicy(self.cfg)
        return self._policy
