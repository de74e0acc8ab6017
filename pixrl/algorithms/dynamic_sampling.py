"""DAPO's dynamic sampling (Yu et al., arXiv 2503.14476; ReasonGen-R1 uses it for Janus-Pro):
a group whose G rewards are all equal carries no group-relative signal, so the iteration keeps
generating rounds of fresh groups until `target` groups with signal are in hand (at most
`sampling.max_rounds` rounds), then trains on the first `target` of them in generation order.

Pure functions of the stored rewards and group ids: the flow's "another round?" decision, the
replay's choice of trained groups, resume and replay all recompute the same answer from the
table. Unlike verl's DAPO, which raises once the cap is hit, the iteration then trains on the
groups it has and logs how many it lacked (`sampling/groups_short`): a hard prompt mix should
slow a run, not end it.
"""

from __future__ import annotations

import numpy as np


def groups_with_signal(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """Ids (ascending) of the groups whose rewards are not all equal."""
    rewards, group_ids = np.asarray(rewards, dtype=np.float64), np.asarray(group_ids)
    if rewards.shape != group_ids.shape:
        raise ValueError(f"{rewards.shape[0]} rewards for {group_ids.shape[0]} group ids")
    ids = np.unique(group_ids)
    return np.array([g for g in ids if np.ptp(rewards[group_ids == g]) > 0], dtype=ids.dtype)


def batch_full(rewards: np.ndarray, group_ids: np.ndarray, target: int) -> bool:
    """Whether `target` groups with signal have been generated."""
    return len(groups_with_signal(rewards, group_ids)) >= target


def trained_groups(rewards: np.ndarray, group_ids: np.ndarray, target: int) -> np.ndarray:
    """The first `target` groups with signal, by group id (= generation order)."""
    return groups_with_signal(rewards, group_ids)[:target]


def trained_mask(rewards: np.ndarray, group_ids: np.ndarray, target: int) -> np.ndarray:
    """Per sample: does its group enter the update?"""
    return np.isin(np.asarray(group_ids), trained_groups(rewards, group_ids, target))
