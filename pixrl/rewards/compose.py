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
                scores = self._score_one(reward, images, prompts, metadata)
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

    def check_installed(self) -> None:
        """Refuse, before a run starts, a reward whose scorer's packages are not installed."""
        import importlib.util

        for name, r in self.rewards.items():
            lacking = [m for m in r.requires if importlib.util.find_spec(m) is None]
            if lacking:
                raise ValueError(f"reward {name!r} needs {', '.join(lacking)}, which is not installed; install it with "
                                 f"`pip install 'pixrl[{r.extra}]'`")

    def check_prompts(self, prompts: list[str], metadata: list[dict]) -> None:
        for r in self.rewards.values():
            r.check_prompts(prompts, metadata)

    def check_media(self, video: bool) -> None:
        """Refuse, before a run starts, a clip-only reward on a family that makes images."""
        clip_only = [n for n, r in self.rewards.items() if r.takes == "clip"]
        if clip_only and not video:
            raise ValueError(f"reward(s) {clip_only} score clips, and this model family makes images; remove them "
                             "from reward.weights or choose a video family")

    @staticmethod
    def _score_one(reward: Reward, images: np.ndarray, prompts: list[str], metadata: list[dict]) -> dict:
        """One reward's scores: clips go whole to a clip reward; an image reward scores every frame
        and each key is averaged over the clip's frames."""
        if images.ndim == 4 or reward.takes == "clip":
            if images.ndim == 4 and reward.takes == "clip":
                raise ScoringError(f"scorer {reward.name!r} scores clips [B, F, H, W, 3]; got images {images.shape}")
            return reward.score(images, prompts, metadata)
        b, f = images.shape[:2]
        frames = images.reshape(b * f, *images.shape[2:])
        scores = reward.score(frames, [p for p in prompts for _ in range(f)], [m for m in metadata for _ in range(f)])
        out = {}
        for key, vals in scores.items():
            vals = np.asarray(vals, dtype=np.float32)
            if vals.shape != (b * f,):
                raise ScoringError(f"scorer {reward.name!r} key {key!r}: expected {b * f} frame scores, got shape "
                                   f"{vals.shape}")
            out[key] = vals.reshape(b, f).mean(axis=1)
        return out
