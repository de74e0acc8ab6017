"""Runs the configured rewards through the scoring contract and sums them by weight.

Validation happens here, before anything is stored: every declared key present, length B,
finite. The total is Σ w_i · r_i over the rewards' main values.
"""

from __future__ import annotations

import numpy as np

from .base import Reward, ScoringError, build_reward, group_keys
from .routing import RewardRoutes


class RewardSet:
    """The run's rewards. `tasks` (rewards/routing.py): per-task weights for the prompts whose
    metadata field `route_by` names a task; the others are scored by `weights`."""

    def __init__(self, weights: dict[str, float], options: dict[str, dict] | None = None, device: str = "cpu",
                 tasks: dict[str, dict[str, float]] | None = None, route_by: str = "category"):
        options = options or {}
        self.routes = RewardRoutes(weights, tasks, route_by)
        names = self.routes.names()
        unknown = set(options) - set(names)
        if unknown:
            raise ValueError(f"reward.options given for {sorted(unknown)} which are not in reward.weights "
                             f"{'or reward.tasks ' if tasks else ''}({', '.join(names)})")
        self.weights = dict(weights)
        self.device = device
        self.rewards: dict[str, Reward] = {n: build_reward(n, **options.get(n, {})) for n in names}

    @classmethod
    def from_config(cls, r, device: str = "cpu") -> RewardSet:
        """From the config's `reward` section (RewardConfig)."""
        return cls(r.weights, r.options, device=device, tasks=r.tasks, route_by=r.route_by)

    @property
    def groupwise(self) -> bool:
        """Whether some reward scores samples against their group (the batch must hold whole groups)."""
        return any(r.groupwise for r in self.rewards.values())

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict],
              sample_ids: list[str], groups: list[str] | None = None) -> dict[str, np.ndarray]:
        """{'reward': total [B], '<name>': [B], '<name>.<diag>': [B], ...}; raises ScoringError.
        `groups`: each sample's group for group rewards (default: `group_keys`). With per-task
        rewards a reward's keys are NaN on the samples it does not score (rewards/routing.py)."""
        n = len(images)
        if self.groupwise and groups is None:
            groups = group_keys(prompts, sample_ids)
        out: dict[str, np.ndarray] = {}
        total = np.zeros(n, dtype=np.float32)
        for name, idx in self.routes.members(metadata).items():  # without tasks: every reward, every sample
            whole = len(idx) == n
            pick = lambda xs: xs if whole or xs is None else [xs[i] for i in idx]  # noqa: E731
            scores = self._checked(name, self.rewards[name], images if whole else images[idx], pick(prompts),
                                   pick(metadata), pick(sample_ids), pick(groups))
            for key, vals in scores.items():
                out.setdefault(key, np.full(n, np.nan, np.float32))[idx] = vals
            total[idx] += self.routes.weights_for(name, pick(metadata)) * out[name][idx]
        out["reward"] = total
        return out

    def _checked(self, name: str, reward: Reward, images, prompts, metadata, sample_ids, groups) -> dict:
        """One reward's scores of these samples, every key [B] and finite — or a ScoringError."""
        n = len(images)
        try:
            reward.ensure_setup(self.device)
            scores = self._score_one(reward, images, prompts, metadata, groups)
        except ScoringError:
            raise
        except Exception as exc:
            raise ScoringError(f"scorer {name!r} failed: {type(exc).__name__}: {exc}") from exc
        if name not in scores:
            raise ScoringError(f"scorer {name!r} returned no {name!r} key (got {sorted(scores)})")
        out = {}
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
        """Each reward accepts the prompts it will score (with per-task rewards: its tasks' own)."""
        self.routes.check_tasks_present(metadata)
        for name, idx in self.routes.members(metadata).items():
            self.rewards[name].check_prompts([prompts[i] for i in idx], [metadata[i] for i in idx])

    def check_scores_everywhere(self, names, setting: str, metadata: list[dict]) -> None:
        """Per-task rewards: refuse `names` (read from every sample by `setting`) where a task these
        prompts (their `metadata`) route to does not score one — its samples would not store it."""
        if not self.routes.routed:
            return
        used = {self.routes.task_of(m) for m in metadata}
        for task in sorted(used, key=lambda t: (t is not None, t or "")):
            weights = self.routes.default if task is None else self.routes.tasks[task]
            lacking = sorted(n for n in names if n.split(".")[0] not in weights)
            if lacking:
                where = "the default (reward.weights)" if task is None else f"task {task!r}"
                raise ValueError(f"{setting} reads {lacking[0]!r} from every sample, and {where} does not score it; "
                                 f"add {lacking[0].split('.')[0]!r} to that task's weights (weight 0 stores it "
                                 f"without adding it to the total)")

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
