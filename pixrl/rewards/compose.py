"""Runs the configured rewards through the scoring contract and sums them by weight.

Validation happens here, before anything is stored: every declared key present, length B,
finite. The total is Σ w_i · r_i over the rewards' main values.
"""

from __future__ import annotations

import numpy as np

from .base import Reward, ScoringError, build_reward


class RewardSet:
    def __init__(self, weights: dict[str, float], options: dict[str, dict] | None = None, device: str = "cpu"):
        options = options or {}
        unknown = set(options) - set(weights)
        if unknown:
            raise ValueError(f"reward.options given for {sorted(unknown)} which are not in reward.weights "
                             f"({', '.join(weights)})")
        self.weights = dict(weights)
        self.device = device
        self.rewards: dict[str, Reward] = {n: build_reward(n, **options.get(n, {})) for n in weights}

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict],
              sample_ids: list[str]) -> dict[str, np.ndarray]:
        """{'reward': total [B], '<name>': [B], '<name>.<diag>': [B], ...}; raises ScoringError."""
        n = len(images)
        out: dict[str, np.ndarray] = {}
        total = np.zeros(n, dtype=np.float32)
        for name, reward in self.rewards.items():
            try:
                reward.ensure_setup(self.device)
                scores = reward.score(images, prompts, metadata)
            except ScoringError:
                raise
            except Exception as exc:
                raise ScoringError(f"scorer {name!r} failed: {type(exc).__name__}: {exc}") from exc
            if name not in scores:
                raise ScoringError(f"scorer {name!r} returned no {name!r} key (got {sorted(scores)})")
            for key, vals in scores.items():
                vals = np.asarray(vals, dtype=np.float32)
                if vals.shape != (n,):
                    raise ScoringError(f"scorer {name!r} key {key!r}: expected {n} scores, got shape {vals.shape}")
                bad = np.flatnonzero(~np.isfinite(vals))
                if bad.size:
                    i = int(bad[0])
                    raise ScoringError(f"scorer {name!r} returned {vals[i]} for sample {sample_ids[i]!r} "
                                       f"(prompt {prompts[i]!r}, key {key!r}); {bad.size} sample(s) affected — "
                                       f"fix the scorer; nothing was written")
                out[key] = vals
            total += self.weights[name] * out[name]
        out["reward"] = total
        return out
