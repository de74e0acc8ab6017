"""DDPO (Black et al. 2023; algorithms.md §10, `kvablack/ddpo-pytorch`, trl's removed
DDPOTrainer): the DDIM-η step (η = 1 by default) with its Gaussian log-prob, per-prompt reward
statistics, PPO-clip (1e-4) with advantages clamped to ±5, no KL.

Rollouts use the `ddim` kernel (`flow_sde.ddim_moments`): on SD1.x/2.x (family `sd15`) it is
ddpo-pytorch's `ddim_step_with_logprob` on the pipeline's own grid, every one of the T steps
stochastic and stored; on a flow-matching family it is the same DDIM-η step of the variance-
preserving process the flow is equivalent to, whose last step onto σ = 0 is deterministic (store
fewer steps: sampling.timestep_fraction). Each micro-batch trains int(T·train_fraction) of the
stored steps, drawn as DanceGRPO draws them (one permutation per micro-batch, so a replay keeps
the rollout's batch geometry; ddpo-pytorch permutes per sample) — with its default 1.0, all.

Advantages follow ddpo-pytorch's PerPromptStatTracker: each prompt keeps a deque of its last
`buffer_size` rewards across iterations — the stage reads the earlier iterations' rewards of this
run from the trajectory store (`reward_history`), so resume, forks and replay see the same deque —
and a prompt whose deque holds at least `min_count` rewards is normalised by the deque's mean and
std (+1e-6), one with fewer by the batch's. Without tracking, (r − mean)/(std + 1e-8) over the batch.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..config.schema import SamplingConfig
from .advantages import GroupAdvantages, checked_rewards
from .base import register_algorithm
from .dance_grpo import DanceGRPO
from .recipe import rollout_recipe
from .sampling import SamplerRecipe


class DDPOSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    clip_range: float = Field(1e-4, gt=0)
    adv_clip_max: float = Field(5.0, gt=0)
    train_fraction: float = Field(1.0, gt=0, le=1, description="ddpo-pytorch's timestep_fraction: the share of "
                                  "the stored steps each micro-batch trains")
    per_prompt_stat_tracking: bool = Field(True, description="normalise by each prompt's statistics")
    min_count: int = Field(16, ge=2, description="rewards a prompt's deque needs for its own statistics (else the "
                           "batch's)")
    buffer_size: int = Field(16, ge=2, description="a prompt's deque: its last this many rewards, this iteration's "
                             "and earlier ones (ddpo-pytorch's per_prompt_stat_tracking.buffer_size)")
    filter_zero_advantage: bool = Field(False, description="ddpo-pytorch trains every sample (a zero advantage "
                                        "still counts in the loss mean)")


def ddpo_advantages(rewards: np.ndarray, group_ids: np.ndarray, per_prompt: bool = True, min_count: int = 16,
                    clip: float = 5.0, prompts: list[str] | None = None,
                    history: dict[str, np.ndarray] | None = None, buffer_size: int = 16) -> GroupAdvantages:
    """ddpo-pytorch's advantages of one batch (module docstring); np.std (ddof 0) throughout.
    `prompts`: each sample's prompt, the tracker's key (None: the group ids); `history`: each
    prompt's earlier rewards, oldest first, that its deque holds before this batch."""
    rewards, group_ids = checked_rewards(rewards, group_ids)
    keys = np.asarray(prompts if prompts is not None else group_ids)
    mean, std = float(np.mean(rewards)), float(np.std(rewards))
    adv = (rewards - mean) / (std + 1e-8) if not per_prompt else np.zeros_like(rewards)
    if per_prompt:
        for key in dict.fromkeys(keys.tolist()):
            idx = keys == key
            r = rewards[idx]
            deque = np.concatenate([np.asarray((history or {}).get(key, ()), np.float64), r])[-buffer_size:]
            own = len(deque) >= min_count
            adv[idx] = (r - (deque.mean() if own else mean)) / ((np.std(deque) if own else std) + 1e-6)
    groups = np.unique(group_ids)
    flat = sum(bool(np.std(rewards[group_ids == g]) == 0) for g in groups)
    adv = np.clip(adv, -clip, clip).astype(np.float32)
    return GroupAdvantages(advantages=adv, zero_std_ratio=flat / max(1, len(groups)), keep=adv != 0)


@register_algorithm("ddpo")
class DDPO(DanceGRPO):
    Settings = DDPOSettings

    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        if sampling.sde_type != "ddim":
            raise ValueError(f"algorithm 'ddpo' samples with the DDIM-η step; set sampling.sde_type=ddim "
                             f"(got {sampling.sde_type!r}), e.g. with the sampling preset ddim")
        if not 0 < sampling.noise_level <= 1:
            raise ValueError(f"algorithm 'ddpo': sampling.noise_level is DDIM's η, in (0, 1] (1: DDPM-like, "
                             f"DDPO's default); got {sampling.noise_level}")
        if sampling.window_size:
            raise ValueError("algorithm 'ddpo' makes every step stochastic; unset sampling.window_size")

    def rollout_recipe(self, sampling: SamplingConfig, rng: np.random.Generator, step: str,
                       iteration: int) -> SamplerRecipe:
        return rollout_recipe(sampling, rng, step)

    @property
    def reward_history(self) -> bool:
        """The advantages read each prompt's rewards of earlier iterations (the tracker's deque)."""
        return self.settings.per_prompt_stat_tracking

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray, prompts: list[str] | None = None,
                   history: dict[str, np.ndarray] | None = None) -> GroupAdvantages:
        c = self.settings
        return ddpo_advantages(rewards, group_ids, c.per_prompt_stat_tracking, c.min_count, c.adv_clip_max,
                               prompts, history, c.buffer_size)
