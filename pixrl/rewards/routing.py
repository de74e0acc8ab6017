"""Per-task rewards: which of a run's rewards score a prompt, and with what weights.

A run that trains on several tasks at once (GenEval-style composition beside text rendering beside
general aesthetics) scores each prompt with its own task's rewards — an OCR reward means nothing
on a prompt without text, and a composition checker nothing on a prompt without objects.
`reward.tasks` maps a task to its weights ({reward: weight}, as `reward.weights`); a prompt's task
is its metadata field `reward.route_by` (default `category`, the field the miniature, GenEval and
the OCR sets carry), and a prompt whose task has no entry is scored by `reward.weights`.

A sample then stores only its own task's scores (its `rewards` list names them) and its total is
Σ w_task,n · r_n over them. Groups share a prompt, so every group's members are scored alike and
group advantages compare like with like. Within one scoring call a reward routed to no sample is
not called; score arrays hold NaN where a reward did not score a sample (never a score of 0).
"""

from __future__ import annotations

import numpy as np


class RewardRoutes:
    """The task → weights table of a run (`tasks` empty: every prompt gets `weights`)."""

    def __init__(self, weights: dict[str, float], tasks: dict[str, dict[str, float]] | None = None,
                 route_by: str = "category"):
        self.default = dict(weights)
        self.tasks = {str(t): dict(w) for t, w in (tasks or {}).items()}
        self.route_by = route_by

    @property
    def routed(self) -> bool:
        return bool(self.tasks)

    def names(self) -> list[str]:
        """Every reward some task (or the default) uses, in first-mention order."""
        seen: dict[str, None] = dict.fromkeys(self.default)
        for w in self.tasks.values():
            seen.update(dict.fromkeys(w))
        return list(seen)

    def task_of(self, meta: dict) -> str | None:
        """The prompt's task key in `tasks`, or None: scored by the default weights."""
        if not self.tasks:
            return None
        task = (meta or {}).get(self.route_by)
        return str(task) if task is not None and str(task) in self.tasks else None

    def weights_of(self, meta: dict) -> dict[str, float]:
        task = self.task_of(meta)
        return self.default if task is None else self.tasks[task]

    def members(self, metadata: list[dict]) -> dict[str, np.ndarray]:
        """{reward: indices of the samples it scores} for the rewards that score any, in `names()`
        order whatever the batch holds — a sample's total sums its rewards in one order, so it does
        not depend on the samples scored beside it."""
        out: dict[str, list[int]] = {}
        for i, meta in enumerate(metadata):
            for name in self.weights_of(meta):
                out.setdefault(name, []).append(i)
        return {n: np.asarray(out[n], dtype=np.int64) for n in self.names() if n in out}

    def weights_for(self, name: str, metadata: list[dict]) -> np.ndarray:
        """[B] float32: reward `name`'s weight in each of these samples' totals (0 where it does not score it)."""
        return np.array([self.weights_of(m).get(name, 0.0) for m in metadata], dtype=np.float32)

    def check_tasks_present(self, metadata: list[dict]) -> None:
        """Refuse a task key no prompt carries (a typo would score its prompts by the default)."""
        present = {str(m[self.route_by]) for m in metadata if (m or {}).get(self.route_by) is not None}
        unknown = sorted(set(self.tasks) - present)
        if unknown:
            have = sorted(present)
            more = " …" if len(have) > 8 else ""
            raise ValueError(f"reward.tasks names {', '.join(repr(t) for t in unknown)}, which no prompt's "
                             f"{self.route_by!r} is (the prompts have: {', '.join(repr(t) for t in have[:8]) or 'none'}"
                             f"{more}); fix or drop the key (dataset.categories may leave its prompts out), or set "
                             f"reward.route_by to the metadata field that names the task")


def merge_parts(parts: list[dict[str, np.ndarray]], sizes: list[int]) -> dict[str, np.ndarray]:
    """Score dicts of consecutive sample ranges, concatenated; a key a part lacks (a routed reward
    that scored none of its samples) is NaN over that part — never 0."""
    keys: dict[str, None] = {}
    for p in parts:
        keys.update(dict.fromkeys(p))
    return {k: np.concatenate([np.asarray(p[k], np.float32) if k in p else np.full(n, np.nan, np.float32)
                               for p, n in zip(parts, sizes)]) for k in keys}
