"""Online Diffusion-DPO (flow_grpo's OnlineDPO, VeRL-Omni's online DPO; algorithms.md §9): every
iteration the current policy samples its groups (ODE: DPO needs samples, not log-probs), the best
and the worst rollout of each group by reward form a preference pair, and the policy takes the
Diffusion-DPO step on the pairs against the reference (adapters off under LoRA, else the base
weights) — the offline loss of diffusion_dpo.py, on fresh pairs of the policy's own samples.

A group whose best and worst rewards differ by no more than `min_margin` (all equal, by
default) gives no pair. The pair travels through the stages as advantages: +1 for the winner,
−1 for the loser, 0 otherwise, so the replay stage's plan keeps exactly the pairs; a micro-batch
holds whole pairs because it is cut from them in rollout order and `sampling.micro_batch` is
even. The loss conditions on each pair's prompt without guidance, as Diffusion-DPO trains.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from ..config.schema import SamplingConfig
from .advantages import GroupAdvantages, checked_rewards
from .base import Algorithm, register_algorithm
from .diffusion_dpo import DPOSettings, pair_loss
from .recipe import ode_recipe
from .sampling import SamplerRecipe


class OnlineDPOSettings(DPOSettings):
    min_margin: float = Field(0.0, ge=0, description="a group pairs its best and worst rollout only when their rewards "
                                                     "differ by more than this")


def best_worst_advantages(rewards: np.ndarray, group_ids: np.ndarray, min_margin: float = 0.0) -> GroupAdvantages:
    """+1 at each group's best reward, −1 at its worst (the first of equals), 0 elsewhere and in
    groups whose spread is ≤ min_margin; zero_std_ratio: the share of groups without a pair."""
    rewards, group_ids = checked_rewards(rewards, group_ids)
    adv = np.zeros(len(rewards), dtype=np.float32)
    groups = list(dict.fromkeys(group_ids.tolist()))
    unpaired = 0
    for g in groups:
        idx = np.flatnonzero(group_ids == g)
        r = rewards[idx]
        if len(idx) < 2 or r.max() - r.min() <= min_margin:
            unpaired += 1
            continue
        adv[idx[int(np.argmax(r))]] = 1.0
        adv[idx[int(np.argmin(r))]] = -1.0
    return GroupAdvantages(advantages=adv, zero_std_ratio=unpaired / max(1, len(groups)), keep=adv != 0)


def pair_order(advantages: np.ndarray, group_ids: np.ndarray) -> tuple[list[int], list[int]]:
    """(winner rows, loser rows) of a micro-batch, pair by pair in order of first appearance."""
    winners, losers = [], []
    for g in dict.fromkeys(np.asarray(group_ids).tolist()):
        idx = np.flatnonzero(np.asarray(group_ids) == g)
        a = np.asarray(advantages)[idx]
        if len(idx) != 2 or sorted(a.tolist()) != [-1.0, 1.0]:
            raise ValueError(f"online_dpo: group {g} has rows with advantages {a.tolist()} in one micro-batch; it "
                             f"trains on whole (best, worst) pairs — use reward.aggregate=reward and an even "
                             f"sampling.micro_batch")
        winners.append(int(idx[int(np.argmax(a))]))
        losers.append(int(idx[int(np.argmin(a))]))
    return winners, losers


@register_algorithm("online_dpo")
class OnlineDPO(Algorithm):
    Settings = OnlineDPOSettings
    needs = frozenset({"final_latent"})
    pairs_in_groups = True  # its advantages mark one (best, worst) pair per group: one reward total to rank by

    @property
    def needs_reference(self) -> bool:
        return True

    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        if step != "denoise":
            raise ValueError("algorithm 'online_dpo' trains flow-matching (denoise) families; token families: token_dpo")
        if sampling.micro_batch % 2:
            raise ValueError(f"algorithm 'online_dpo' trains whole (best, worst) pairs: set sampling.micro_batch to "
                             f"an even number (got {sampling.micro_batch})")

    def rollout_recipe(self, sampling: SamplingConfig, rng: np.random.Generator, step: str,
                       iteration: int) -> SamplerRecipe:
        """The ODE sampler (no stochastic step, nothing but the final latents stored)."""
        return ode_recipe(sampling)

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        return best_worst_advantages(rewards, group_ids, self.settings.min_margin)

    def trains_on(self, advantages: np.ndarray, group_ids: np.ndarray | None = None) -> np.ndarray:
        return np.asarray(advantages) != 0

    def losses(self, batch, policy):
        winners, losers = pair_order(batch["advantage"], batch["group_id"])
        x0 = policy.tensor(np.asarray(batch["final_latent"])[winners + losers])
        b = len(winners)
        yield pair_loss(x0[:b], x0[b:], policy.cond.select(winners + losers), self.settings, policy)
