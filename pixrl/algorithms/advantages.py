"""Per-prompt group advantages (Flow-GRPO §2.5, `PerPromptStatTracker.update`, type='grpo').

A_i = (r_i − mean_group) / (std + eps), std = np.std (ddof 0) of the whole batch when
global_std else of the group; then clipped to ±adv_clip_max. zero_std_ratio is the fraction of
groups whose rewards are all equal (they carry no signal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class GroupAdvantages:
    advantages: np.ndarray  # float32 [N], clipped
    zero_std_ratio: float
    keep: np.ndarray  # bool [N]; False where the advantage is exactly zero (filtered samples)


def checked_rewards(rewards, group_ids) -> tuple[np.ndarray, np.ndarray]:
    """(rewards as float64, group ids) of equal 1-D shapes with finite rewards, or a ValueError."""
    rewards = np.asarray(rewards, dtype=np.float64)
    group_ids = np.asarray(group_ids)
    if rewards.ndim != 1 or rewards.shape != group_ids.shape:
        raise ValueError(f"rewards {rewards.shape} and group_ids {group_ids.shape} must be equal 1-D shapes")
    if not np.all(np.isfinite(rewards)):
        raise ValueError("rewards contain NaN/inf; the score stage must reject them")
    return rewards, group_ids


def group_advantages(
    rewards: np.ndarray,
    group_ids: np.ndarray,
    global_std: bool = True,
    eps: float = 1e-4,
    clip: float = 5.0,
) -> GroupAdvantages:
    rewards, group_ids = checked_rewards(rewards, group_ids)
    adv = np.zeros_like(rewards)
    batch_std = float(np.std(rewards))
    groups = np.unique(group_ids)
    zero_std = 0
    for g in groups:
        idx = group_ids == g
        r = rewards[idx]
        if np.std(r) == 0:
            zero_std += 1
        std = batch_std if global_std else float(np.std(r))
        adv[idx] = (r - r.mean()) / (std + eps)
    adv = np.clip(adv, -clip, clip).astype(np.float32)
    return GroupAdvantages(advantages=adv, zero_std_ratio=zero_std / max(1, len(groups)), keep=adv != 0)


def stored_scores(rewards_rows: list, names, sample_ids: list[str]) -> dict[str, np.ndarray]:
    """{name: [N] float64} from the rows' stored `rewards` (a list of {name, value} per row): a
    reward's own score or a component it stores; a row without one is a ValueError naming it."""
    rows = [{c["name"]: c["value"] for c in row} for row in rewards_rows]
    out = {}
    for name in names:
        lacking = [i for i, r in enumerate(rows) if name not in r]
        if lacking:
            raise ValueError(f"the stored score {name!r} is missing from sample {sample_ids[lacking[0]]!r} (it has "
                             f"{', '.join(sorted(rows[lacking[0]]))}); add its reward to reward.weights")
        out[name] = np.array([r[name] for r in rows], np.float64)
    return out


def aggregated_advantages(estimate, components: dict[str, np.ndarray], weights: dict[str, float],
                          group_ids: np.ndarray) -> GroupAdvantages:
    """MixGRPO's `advantage_aggr` for several rewards: each weighted reward normalised in its
    group on its own by the algorithm's estimator `estimate(rewards, group_ids)`, then the
    advantages summed, A = Σ_k w_k·A_k — so a reward with a small spread counts as much as one
    with a large spread (summing the rewards first lets the wide one dominate)."""
    missing = sorted(set(weights) - set(components))
    if missing:
        raise ValueError(f"reward component(s) {missing} are not stored with the samples; cannot aggregate advantages")
    total = sum(w * estimate(components[name], group_ids).advantages.astype(np.float64) for name, w in weights.items())
    total = np.asarray(total, dtype=np.float32)
    groups = np.unique(group_ids)
    flat = sum(1 for g in groups if not np.any(total[group_ids == g]))
    return GroupAdvantages(advantages=total, zero_std_ratio=flat / max(1, len(groups)), keep=total != 0)


def unbiased_group_advantages(rewards: np.ndarray, group_ids: np.ndarray, eps: float = 1e-8,
                              clip: float = 5.0) -> GroupAdvantages:
    """DanceGRPO's and MixGRPO's estimator (algorithms.md §4.2, §5.2): each group on its own,
    A = (r − mean_g)/(std_g + eps) with torch.std's unbiased std (ddof 1) and eps 1e-8; clipped
    to ±clip as their loss clamps it."""
    rewards, group_ids = checked_rewards(rewards, group_ids)
    adv = np.zeros_like(rewards)
    groups = np.unique(group_ids)
    flat = 0
    for g in groups:
        idx = group_ids == g
        r = rewards[idx]
        if len(r) < 2:
            raise ValueError(f"group {g} has {len(r)} sample; the unbiased std needs groups of at least 2")
        std = float(np.std(r, ddof=1))
        flat += std == 0
        adv[idx] = (r - r.mean()) / (std + eps)
    adv = np.clip(adv, -clip, clip).astype(np.float32)
    return GroupAdvantages(advantages=adv, zero_std_ratio=flat / max(1, len(groups)), keep=adv != 0)


def per_part(estimate, parts: np.ndarray):
    """An estimator `estimate(rewards, group_ids)` applied to each part of an iteration in parts
    on its own (Algorithm.rollout_parts): a part's rewards come from its own recipe — TempFlow-GRPO
    branches at one step per part, and its global std is the std over that step's children
    (PerPromptStatTracker's axis-0 std of a [samples, steps] reward array)."""
    parts = np.asarray(parts)

    def estimate_by_part(rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        rewards, group_ids = np.asarray(rewards), np.asarray(group_ids)
        adv = np.zeros(len(rewards), np.float32)
        groups = flat = 0.0
        for p in dict.fromkeys(parts.tolist()):
            rows = parts == p
            got = estimate(rewards[rows], group_ids[rows])
            adv[rows] = got.advantages
            n = len(np.unique(group_ids[rows]))
            groups, flat = groups + n, flat + got.zero_std_ratio * n
        return GroupAdvantages(advantages=adv, zero_std_ratio=flat / max(1.0, groups), keep=adv != 0)

    return estimate_by_part


def part_reward_spread(rewards: np.ndarray, group_ids: np.ndarray, parts: np.ndarray) -> dict[str, float]:
    """`part/<i>/reward_std`: the mean within-group reward std of each part — with TempFlow-GRPO,
    how much the final reward depends on the noise of that part's branch step."""
    rewards, group_ids, parts = np.asarray(rewards, np.float64), np.asarray(group_ids), np.asarray(parts)
    out = {}
    for p in dict.fromkeys(parts.tolist()):
        rows = parts == p
        stds = [np.std(rewards[rows & (group_ids == g)]) for g in np.unique(group_ids[rows])]
        out[f"part/{p}/reward_std"] = float(np.mean(stds))
    return out
