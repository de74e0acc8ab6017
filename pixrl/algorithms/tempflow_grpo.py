"""TempFlow-GRPO (He et al. 2025, arXiv 2508.04324; algorithms.md §6.1): process rewards by
trajectory branching, and a noise-aware weight on each step's policy loss.

- Branching. Each prompt has B base trajectories (`sampling.group_size / children`), sampled by
  ODE from their own initial latents. At a branch step j, K = `children` SDE draws leave the
  base's x_j, and each child finishes by ODE: its image's reward is a process reward for the one
  stochastic action it took, with nothing else random after x_T. `sde_step_with_logprob_perstep`
  branches at every step of `timesteps[:-1]`; here at `branch_steps` (default: the first
  int(T·timestep_fraction) steps, 9 of 10, the steps Flow-GRPO trains).
- Parts. Each branch step is one part of the iteration's rollout (`rollout_parts`): every prompt
  gets one group per branch step, of B·K rows that store only their branch transition, and the
  B initial latents of a prompt are the same in every part (seeds keyed by prompt and base).
- Advantages: per group (prompt and branch step) as flow_grpo's PerPromptStatTracker does on the
  [samples, steps] reward array — mean over the B·K children, std of the group, or with
  `global_std` of all children at that step (each part is normalised on its own).
- Loss per row, at its branch step: PPO-clip with the weight w = `noise_weight`·std_j, std_j =
  s_t·sqrt(−Δ) the step's noise (`train_sd3_pr.py`: −2.25·std_dev_t·A·ρ), so early, noisy
  steps learn most; KL β·mean(μθ − μref)²/(2·std_j²) on the same std.

The reference branches its K children off one ODE backbone per base; here each row is an
ordinary rollout of its own, and the children of a base (one prompt, one initial latent, one
micro-batch) take the steps before their branch once (`sampling._shared_prefix`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..config.schema import SamplingConfig
from .advantages import GroupAdvantages, group_advantages
from .base import register_algorithm
from .flow_grpo import FlowGRPO
from .losses import ppo_clip_loss
from .recipe import trained_step_count
from .sampling import SamplerRecipe


class TempFlowGRPOSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    children: int = Field(6, ge=2, description="K: SDE children of each base at a branch step (per-branch exploration)")
    branch_steps: list[int] | None = Field(None, description="steps that branch; None: the first "
                                           "int(T·timestep_fraction)")
    weighting: Literal["noise", "none"] = Field("noise", description="noise: the loss of step j weighted by "
                                                "noise_weight·std_j; none: Flow-GRPO's unweighted loss")
    noise_weight: float = Field(2.25, gt=0)
    clip_range: float = Field(1e-4, gt=0)
    adv_clip_max: float = Field(5.0, gt=0)
    std_eps: float = Field(1e-4, gt=0)
    global_std: bool = False
    filter_zero_advantage: bool = True
    beta: float = Field(0.0, ge=0, description="KL-to-reference weight")


@register_algorithm("tempflow_grpo")
class TempFlowGRPO(FlowGRPO):
    Settings = TempFlowGRPOSettings

    def branches(self, sampling: SamplingConfig) -> tuple[int, ...]:
        steps = self.settings.branch_steps
        return tuple(range(trained_step_count(sampling))) if steps is None else tuple(steps)

    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        c, name = self.settings, "algorithm 'tempflow_grpo'"
        if step != "denoise":
            raise ValueError(f"{name} branches denoising trajectories; the model is a token family")
        if sampling.window_size:
            raise ValueError(f"{name} places one stochastic step per row (its branch step); unset "
                             f"sampling.window_size, which is Flow-GRPO-Fast's")
        if sampling.noise_level <= 0 or sampling.sde_type not in ("sde", "cps"):
            raise ValueError(f"{name} branches with the Flow-GRPO SDE or CPS: set sampling.sde_type=sde (or cps) and "
                             f"sampling.noise_level > 0 (got {sampling.sde_type!r}, {sampling.noise_level})")
        if sampling.group_size % c.children:
            raise ValueError(f"sampling.group_size={sampling.group_size} must be a multiple of algorithm.children="
                             f"{c.children}: a group is B bases × K children at one branch step")
        if sampling.max_rounds > 1:
            raise ValueError(f"{name} samples its branch steps as parts of one round; set sampling.max_rounds=1")
        steps = self.branches(sampling)
        bad = [k for k in steps if not 0 <= k < sampling.steps]
        if not steps or bad or len(set(steps)) != len(steps):
            raise ValueError(f"algorithm.branch_steps={list(steps)} must be distinct steps of 0..{sampling.steps - 1}")

    def rollout_parts(self, sampling: SamplingConfig, rng: np.random.Generator, step: str,
                      iteration: int) -> list[SamplerRecipe]:
        """One part per branch step j: SDE at j only, the transition at j stored, the prompt's
        bases' initial latents shared by their K children and across parts."""
        return [SamplerRecipe(sampling.steps, sampling.noise_level, sampling.sde_type, sampling.guidance_scale, (j,),
                              (j,), shared_noise=True, shared_members=self.settings.children)
                for j in self.branches(sampling)]

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        c = self.settings
        return group_advantages(rewards, group_ids, c.global_std, c.std_eps, c.adv_clip_max)

    def trained_positions(self, batch, policy) -> list[int]:
        steps = np.asarray(batch["stored_steps"])
        if len(np.unique(steps[:, 0])) > 1:
            raise ValueError(f"a micro-batch holds rows of branch steps {sorted(set(steps[:, 0].tolist()))}; the update "
                             f"plans each part's rows on their own")
        return super().trained_positions(batch, policy)

    def step_loss(self, tr, batch, adv, policy):
        """Flow-GRPO's PPO-clip at the row's branch step, weighted by that step's noise."""
        c = self.settings
        weight = c.noise_weight * tr.new.std.detach() if c.weighting == "noise" else None
        old = policy.tensor(batch["log_probs"][:, tr.j])
        both = tr.weight if weight is None else weight if tr.weight is None else weight * tr.weight
        loss, metrics = ppo_clip_loss(tr.new.log_prob, old, adv, c.clip_range, c.adv_clip_max, both)
        if weight is not None:
            metrics["noise_weight"] = weight.mean()
        if c.beta > 0:
            kl = self.reference_kl(tr, policy, tr.new.std)
            loss = loss + c.beta * kl
            metrics["kl"] = kl.detach()
        return loss, metrics
