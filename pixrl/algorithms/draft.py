"""Direct reward fine-tuning: the reward model's gradient, through the decode and the last denoising
steps, trains the policy — DRaFT (Clark et al., ICLR 2024, arXiv 2309.17400), ReFL (Xu et al.,
ImageReward, NeurIPS 2023, arXiv 2304.05977; THUDM/ImageReward `ReFL.py`) and AlignProp's
randomized truncation (Prabhudesai et al., arXiv 2310.03739). Not a policy gradient: no log-prob,
no advantage; the reward must be differentiable (rewards/differentiable.py).

Rollouts: the deterministic ODE on the family's grid (T steps, sampling.guidance_scale, the
run's negative prompt); the latent x_k at the iteration's start step k is stored (its log-prob
column is NaN: a deterministic step has no density), and the final latent.

Update, per sample, from the stored x_k with the gradient on: K steps of the policy's velocity
(the rollout's own step function, guidance and grid), the last one a jump to the clean estimate

    x_{j+1} = x_j + (σ_{j+1} − σ_j)·v_θ(x_j, t_j)     for j = k … k+K−2
    x̂_0     = x_{k+K−1} − σ_{k+K−1}·v_θ(x_{k+K−1}, t_{k+K−1})

(the Euler step onto σ = 0 when k + K = T), then the differentiable decode and the reward r:

    reward:  L = −scale · mean_B r(x̂_0)                           (DRaFT; AlignProp's |10 − r| alike while r < 10)
    hinge:   L = scale · mean_B relu(threshold − r(x̂_0))           (ReFL: threshold 2, scale 10⁻³)

Which k and K:
- DRaFT-K (`grad_steps` = K): k = T − K, the gradient through the last K steps to the end.
- AlignProp (`grad_steps_range` = [lo, hi]): K ~ U{lo … hi} drawn once per iteration, k = T − K.
- ReFL (`start_fraction` = [a, b)): k ~ U{⌊a·T⌋ … ⌈b·T⌉ − 1} drawn once per iteration, K =
  min(`grad_steps`, T − k); ReFL's 40-step recipe draws k in 30 … 39 with K = 1.
- DRaFT-LV (`lv_samples` = n, K = 1): n fresh noisings of the stored final latent to the last
  step's σ, x_i = σ·ε_i + (1 − σ)·x_0 (ε_i from the update's seeded generator), each denoised in
  one step and scored — n loss terms in place of the stored x_{T−1}'s.

Families: the flow-matching ones with a differentiable decode, and the DDPM ones the papers trained
(SD1.x, SDXL, PixArt-Σ), stepped as their equivalent flow — there the jump is DDIM's predicted
clean latent x̂0 of the model's output (what ReFL.py decodes), and DRaFT's chain to the end the DDIM
steps then x̂0 of the last.

Where pixrl departs, and why: the draws are per iteration (ReFL and AlignProp draw per batch),
recorded in the row's recipe and stored steps, so an update is a function of its rows and replays
bit for bit; ReFL.py hands its U-Net the step *index* as the timestep (and steps the scheduler
at the loop's last t), here the model reads the grid's own timestep of step k.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..config.schema import SamplingConfig
from .advantages import GroupAdvantages, group_advantages
from .base import Algorithm, register_algorithm
from .recipe import ode_recipe
from .reward_gradient import bound_reward, check_gradient_family, check_gradient_reward
from .sampling import SamplerRecipe, denoise_step


class DRaFTSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: str = Field("aesthetic", description="the differentiable reward whose gradient trains: one of the run's "
                                                 "rewards (reward.weights; weight 0 scores it without adding it)")
    grad_steps: int = Field(1, ge=1, description="K, the steps the gradient runs through (DRaFT-K)")
    grad_steps_range: tuple[int, int] | None = Field(None, description="AlignProp's randomized truncation: K drawn "
                                                                       "per iteration in [lo, hi], to the grid's end")
    start_fraction: tuple[float, float] | None = Field(None, description="ReFL: the start step drawn per iteration "
                                                                         "in [a·T, b·T); x̂0 predicted after K steps")
    lv_samples: int = Field(0, ge=0, description="DRaFT-LV: n re-noisings of the final latent (K = 1); 0: off")
    objective: Literal["reward", "hinge"] = Field("reward", description="−r (DRaFT, AlignProp) or "
                                                                        "relu(threshold − r) (ReFL)")
    threshold: float = Field(2.0, description="the hinge's threshold (ReFL: 2 on ImageReward's z-score)")
    reward_scale: float = Field(1.0, gt=0, description="the loss's factor (ReFL's grad_scale 1e-3)")

    @model_validator(mode="after")
    def _one_schedule(self):
        if self.grad_steps_range is not None and self.start_fraction is not None:
            raise ValueError("grad_steps_range (AlignProp: K drawn, to the end) and start_fraction (ReFL: the start "
                             "drawn) are two ways of choosing the steps; set one")
        if self.grad_steps_range is not None and not 1 <= self.grad_steps_range[0] <= self.grad_steps_range[1]:
            raise ValueError(f"grad_steps_range={self.grad_steps_range}: two step counts 1 ≤ lo ≤ hi")
        if self.start_fraction is not None and not 0 <= self.start_fraction[0] < self.start_fraction[1] <= 1:
            raise ValueError(f"start_fraction={self.start_fraction}: two fractions of the grid 0 ≤ a < b ≤ 1")
        if self.lv_samples and (self.grad_steps != 1 or self.grad_steps_range or self.start_fraction):
            raise ValueError(f"lv_samples={self.lv_samples} (DRaFT-LV) re-noises the final latent to the last step: "
                             f"it takes grad_steps=1 and neither grad_steps_range nor start_fraction")
        return self


@register_algorithm("draft")
class DRaFT(Algorithm):
    Settings = DRaFTSettings
    needs = frozenset({"stored_steps", "latents", "final_latent"})

    def __init__(self, cfg):
        super().__init__(cfg)
        self._rewards = None

    # --- what it can train, checked before a run --------------------------------------------------
    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        if step != "denoise":
            raise ValueError(f"algorithm '{self.name}' trains flow-matching (denoise) families")
        if sampling.max_rounds > 1:
            raise ValueError(f"algorithm '{self.name}' trains every sample (the reward's gradient, no advantage); "
                             f"set sampling.max_rounds=1")
        lo, hi = self.start_range(sampling.steps)
        most = self.settings.grad_steps_range[1] if self.settings.grad_steps_range else self.settings.grad_steps
        if hi <= lo or (self.settings.start_fraction is None and most > sampling.steps):
            raise ValueError(f"algorithm '{self.name}': its gradient steps ({self._which()}) do not fit "
                             f"sampling.steps={sampling.steps}; lower them or raise sampling.steps")

    def check_family(self, family, model=None) -> None:
        check_gradient_family(self.name, family, variance_preserving=True)

    def check_rewards(self, rewards) -> None:
        from ..rewards.differentiable import differentiable_rewards

        check_gradient_reward(self.name, self.settings.reward, rewards, differentiable_rewards())

    def bind_rewards(self, rewards) -> None:
        self._rewards = rewards

    # --- rollouts ---------------------------------------------------------------------------------
    def start_range(self, steps: int) -> tuple[int, int]:
        """[lo, hi): the start steps k a draw can take on a grid of `steps`."""
        c = self.settings
        if c.start_fraction is not None:
            return int(np.floor(c.start_fraction[0] * steps)), min(int(np.ceil(c.start_fraction[1] * steps)), steps)
        if c.grad_steps_range is not None:
            return max(steps - c.grad_steps_range[1], 0), steps - c.grad_steps_range[0] + 1
        return steps - c.grad_steps, steps - c.grad_steps + 1

    def rollout_recipe(self, sampling: SamplingConfig, rng: np.random.Generator, step: str,
                       iteration: int) -> SamplerRecipe:
        """The ODE, storing x_k at the iteration's start step (drawn from the iteration's rng)."""
        lo, hi = self.start_range(sampling.steps)
        k = int(rng.integers(lo, hi)) if hi - lo > 1 else lo
        return replace(ode_recipe(sampling), train_steps=(k,))

    def grad_steps_from(self, k: int, steps: int) -> int:
        """K for a start step k: to the end (DRaFT, AlignProp), or grad_steps within the grid (ReFL)."""
        return min(self.settings.grad_steps, steps - k) if self.settings.start_fraction is not None else steps - k

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        """Group advantages, stored for comparison with the policy-gradient runs; the loss reads none."""
        return group_advantages(rewards, group_ids, False, 1e-4, 5.0)

    # --- update -----------------------------------------------------------------------------------
    def terms(self, batch, trained_steps: frozenset[int] | None = None) -> int:
        return self.settings.lv_samples or 1

    def losses(self, batch, policy):
        c, fam = self.settings, policy.model
        reward = bound_reward(self.name, self._rewards, c.reward)
        steps = len(policy.timesteps)
        k = _start_step(batch["stored_steps"])
        prompts = list(batch["prompt"])
        if c.lv_samples:
            x0 = policy.tensor(batch["final_latent"]).float()
            sigma = float(policy.sigmas[k])
            for _ in range(c.lv_samples):
                eps = torch.randn(x0.shape, generator=policy.generator, device=policy.generator.device).to(x0.device)
                x = sigma * eps + (1 - sigma) * x0
                yield self._term(reward, prompts, fam.decode_pixels(clean_estimate(policy, x, k, 1)), k, 1)
            return
        n = self.grad_steps_from(k, steps)
        x = policy.tensor(batch["latents"][:, 0]).float()
        yield self._term(reward, prompts, fam.decode_pixels(clean_estimate(policy, x, k, n)), k, n)

    def _term(self, reward, prompts: list[str], pixels: torch.Tensor, k: int, n: int):
        """The loss of decoded estimates [B, 3, H, W] and what it logs."""
        c = self.settings
        r = reward.pixel_scores(pixels, prompts).float()
        loss = -r.mean() if c.objective == "reward" else torch.relu(c.threshold - r).mean()
        return c.reward_scale * loss, {f"{self.name}/reward": r.mean().detach(),
                                       f"{self.name}/start_step": torch.tensor(float(k)),
                                       f"{self.name}/grad_steps": torch.tensor(float(n))}

    def _which(self) -> str:
        c = self.settings
        if c.start_fraction is not None:
            return f"start_fraction={c.start_fraction}"
        return f"grad_steps_range={c.grad_steps_range}" if c.grad_steps_range else f"grad_steps={c.grad_steps}"


def clean_estimate(policy, x: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """x̂_0 from x_k with the gradient on: n − 1 of the rollout's own (ODE) steps, then the jump
    x − σ_j·v_θ(x, t_j) at step j = k + n − 1 (the Euler step onto σ = 0 at the grid's last step)."""
    fam = policy.model
    sigmas, timesteps = policy.sigmas, policy.timesteps
    for j in range(k, k + n):
        out = denoise_step(fam, x, j, sigmas, timesteps, policy.cond, policy.neg, policy.recipe)
        x = x - float(sigmas[j]) * out.velocity if j == k + n - 1 else out.prev_sample
    return x


def _start_step(stored_steps) -> int:
    """The one start step of these rows (an iteration draws one)."""
    ks = np.unique(np.asarray(stored_steps)[:, 0])
    if len(ks) != 1:
        raise ValueError(f"the rows of one update were stored at different start steps {ks.tolist()}; an update "
                         f"trains one iteration's rows, which share one")
    return int(ks[0])


@register_algorithm("refl")
class ReFL(DRaFT):
    """ReFL's defaults (ReFL.py): ImageReward, the start step in the last quarter of the grid
    (30 … 39 of 40), one step with the gradient, relu(2 − r)·10⁻³."""

    class Settings(DRaFTSettings):
        reward: str = "imagereward"
        start_fraction: tuple[float, float] | None = (0.75, 1.0)
        objective: Literal["reward", "hinge"] = "hinge"
        threshold: float = 2.0
        reward_scale: float = 1e-3
