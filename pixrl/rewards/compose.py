"""Runs the configured rewards through the scoring contract and sums them by weight.

Validation happens here, before anything is stored: every declared key present, length B,
finite. The total is Σ w_i · r_i over the rewards' main values.
"""

from __future__ import annotations

import numpy as np

from .base import Reward, ScoringError, build_reward, group_keys


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

    @property
    def groupwise(self) -> bool:
        """Whether some reward scores samples against their group (the batch must hold whole groups)."""
        return any(r.groupwise for r in self.rewards.values())

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict],
              sample_ids: list[str], groups: list[str] | None = None) -> dict[str, np.ndarray]:
        """{'reward': total [B], '<name>': [B], '<name>.<diag>': [B], ...}; raises ScoringError.
        `groups`: each sample's group for group rewards (default: `group_keys`)."""
        n = len(images)
        if self.groupwise and groups is None:
            groups = group_keys(prompts, sample_ids)
        out: dict[str, np.ndarray] = {}
        total = np.zeros(n, dtype=np.float32)
        for name, reward in self.rewards.items():
            try:
                reward.ensure_setup(self.device)
                scores = self._score_one(reward, images, prompts, metadata, groups)
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

    def connect(self) -> None:
        """Before a run starts: what every reward scored elsewhere (`remote`) scores, from its
        server — so the checks below see the served rewards, not the client."""
        for r in self.rewards.values():
            r.connect()

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

    def check_advantage_parts(self, parts: dict[str, float] | None) -> None:
        """Refuse, before a run starts, reward.advantage_weights naming a score no reward stores."""
        self.check_scores(parts or {}, "reward.advantage_weights")

    def check_scores(self, names, setting: str) -> None:
        """Refuse `names` (read by `setting`) where one is not a score these rewards store: each
        reward's own, or a component it declares (`Reward.components`)."""
        stored = {n for n in self.rewards} | {f"{n}.{c}" for n, r in self.rewards.items() for c in r.components}
        unknown = sorted(set(names) - stored)
        if unknown:
            raise ValueError(f"{setting}: {unknown[0]!r} is not a score these rewards store; they store "
                             f"{', '.join(sorted(stored))} — add its reward to reward.weights (weight 0 stores it "
                             f"without adding it to the total)")

    def check_media(self, video: bool, audio: bool = False) -> None:
        """Refuse, before a run starts, a clip-only reward on a family that makes images, a
        soundtrack reward on a family whose clips are silent, a group reward on clips (served
        rewards by their own names, after `connect`)."""
        takes = {n: t for r in self.rewards.values() for n, t in r.scorers().items()}
        clip_only = [n for n, t in takes.items() if t == "clip"]
        if clip_only and not video:
            raise ValueError(f"reward(s) {clip_only} score clips, and this model family makes images; remove them "
                             "from reward.weights or choose a video family")
        hearing = [n for n, t in takes.items() if t == "soundtrack"]
        if hearing and not audio:
            raise ValueError(f"reward(s) {hearing} score a clip's soundtrack, and this model family makes no sound; "
                             "remove them from reward.weights or choose a family whose clips have sound (ltx2)")
        paired = [n for n, r in self.rewards.items() if r.groupwise]
        if paired and video:
            raise ValueError(f"reward(s) {paired} compare the images of a group, and this model family makes clips; "
                             "remove them from reward.weights or choose an image family")

    @staticmethod
    def _score_one(reward: Reward, images: np.ndarray, prompts: list[str], metadata: list[dict],
                   groups: list[str] | None = None) -> dict:
        """One reward's scores: clips go whole to a clip reward and to a soundtrack reward (whose
        samples' metadata must hold their `soundtrack`) and to a served set (`media`); an image reward
        scores every frame and each key is averaged over the clip's frames; a group reward gets the
        groups."""
        if reward.groupwise:
            if images.ndim != 4:
                raise ScoringError(f"scorer {reward.name!r} compares images [B, H, W, 3]; got {images.shape}")
            first: dict[str, int] = {}
            for i, g in enumerate(groups):
                first.setdefault(g, i)
            order = np.array(sorted(range(len(groups)), key=lambda i: (first[groups[i]], i)))  # each group together
            scores = reward.score(images[order], [prompts[i] for i in order], [metadata[i] for i in order],
                                  groups=[groups[i] for i in order])
            back = np.argsort(order)
            return {k: np.asarray(v)[back] if np.ndim(v) == 1 and len(v) == len(order) else v for k, v in scores.items()}
        if reward.takes == "soundtrack":
            silent = [i for i, m in enumerate(metadata) if not m.get("soundtrack")]
            if silent:
                raise ScoringError(f"scorer {reward.name!r} scores soundtracks, and {len(silent)} sample(s) have none "
                                   f"(prompt {prompts[silent[0]]!r}); decode writes them for a family whose clips "
                                   f"have sound (ltx2)")
            return reward.score(images, prompts, metadata)
        if images.ndim == 4 or reward.takes in ("clip", "media"):
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
