"""Preference pairs from groups of samples of one prompt (rollout groups of a GRPO run).

best_worst: one pair per group, the highest against the lowest reward (flow_grpo's 'dpo' stat
tracker). all: every (i, j) with r_i − r_j ≥ margin. Either way ties (equal rewards) are dropped
and a pair never crosses groups, so never crosses prompts.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

PAIRINGS = ("best_worst", "all")


@dataclass
class Pairs:
    winner: np.ndarray  # int indices into the selection
    loser: np.ndarray
    groups: int  # groups seen
    groups_without_pair: int  # all-tied (or below margin) groups

    @property
    def count(self) -> int:
        return len(self.winner)


def make_pairs(group_keys: list, rewards: np.ndarray, mode: str = "best_worst", margin: float = 0.0) -> Pairs:
    if mode not in PAIRINGS:
        raise ValueError(f"unknown pairing {mode!r}; choose one of {', '.join(PAIRINGS)}")
    if margin < 0:
        raise ValueError(f"pairing margin must be ≥ 0, got {margin}")
    rewards = np.asarray(rewards, dtype=np.float64)
    if not np.all(np.isfinite(rewards)):
        raise ValueError("rewards contain NaN/inf; pairs need scored samples")
    members: dict = defaultdict(list)
    for i, k in enumerate(group_keys):
        members[k].append(i)
    win, lose, empty = [], [], 0
    for idx in members.values():
        r = rewards[idx]
        found = False
        if mode == "best_worst":
            hi, lo = idx[int(np.argmax(r))], idx[int(np.argmin(r))]
            d = rewards[hi] - rewards[lo]
            if d > 0 and d >= margin:
                win.append(hi)
                lose.append(lo)
                found = True
        else:
            for a in idx:
                for b in idx:
                    d = rewards[a] - rewards[b]
                    if d > 0 and d >= margin:
                        win.append(a)
                        lose.append(b)
                        found = True
        empty += not found
    return Pairs(np.array(win, dtype=np.int64), np.array(lose, dtype=np.int64), len(members), empty)


def pair_order(categories: list[str], steps: int, per_step: int, balance: str, rng: np.random.Generator) -> list[list[int]]:
    """Pair indices for each optimizer step. 'none': epochs of a fixed-seed permutation of all pairs.
    'category': the categories in turn (each its own permutation, refilled when used up), so every
    category contributes about per_step / n_categories pairs per step however many pairs it has."""
    if balance == "none":
        order: list[int] = []
        out = []
        for _ in range(steps):
            if len(order) < per_step:
                order += rng.permutation(len(categories)).tolist()
            out.append(order[:per_step])
            order = order[per_step:]
        return out
    by_cat: dict[str, list[int]] = {}
    for i, c in enumerate(categories):
        by_cat.setdefault(c, []).append(i)
    names = sorted(by_cat)
    queues: dict[str, list[int]] = {c: [] for c in names}
    out, k = [], 0
    for _ in range(steps):
        batch = []
        for _ in range(per_step):
            c = names[k % len(names)]
            k += 1
            if not queues[c]:
                queues[c] = [by_cat[c][int(j)] for j in rng.permutation(len(by_cat[c]))]
            batch.append(queues[c].pop())
        out.append(batch)
    return out
