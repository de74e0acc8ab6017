"""Online SFT (flow_grpo's SFT / OnlineSFT: `scripts/train_sd3_sft.py`, `config/sft.py`,
`PerPromptStatTracker.update(type='sft')`): reward-ranked fine-tuning on the policy's own samples.

Each iteration samples its groups (the sampling config's SDE, so a group is diverse; nothing but
the final latents stored), picks the samples whose reward is their group's maximum (ties all — a
group of equal rewards trains every member, as upstream's `== max` does), and takes flow-matching
steps on these winners' final latents: σ from the model's training
schedule (logit-normal, shifted: `NoiseLevelSettings`), fresh ε, x_σ = (1−σ)·x0 + σ·ε,
L = mean ‖(ε − x0) − v_θ(x_σ, σ, c)‖², conditional, no guidance, no reference. An iteration
takes `noise_draws` passes over the winners (upstream: int(T·timestep_fraction)), each one noise
draw per winner and its own optimizer steps, as upstream steps its optimizer inside its loop
over `train_timesteps`.

Upstream averages the loss over every sample of its batch, the non-winners adding 0: the
gradient of one winner is divided by the batch, about G rows per winner. pixrl trains the winners
only, each weighted by 1/G — the stored `advantage` is that weight — so the gradient is the same
in expectation at the same learning rate.

The sampling policy: upstream samples with a "ref" adapter that is copied from the trained one
every `ref_update_step` optimizer steps (40 for OnlineSFT; never for SFT, which then fine-tunes
on the base model's samples). `sampler_sync_every` is that number (None: the current policy
samples, fully online); the sampler is refreshed when the optimizer-step count crosses a
multiple of it (upstream tests divisibility at each epoch start, which skips multiples when an
epoch takes several steps).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from ..config.schema import SamplingConfig
from .advantages import GroupAdvantages, checked_rewards
from .base import Algorithm, register_algorithm
from .diffusion_dpo import NoiseLevelSettings, draw_noise_levels, noised, prediction_error
from .sampling import SamplerRecipe, conditional_scale, model_timesteps


class OnlineSFTSettings(NoiseLevelSettings):
    noise_draws: int = Field(9, ge=1, description="rounds over the winners per iteration, each one noise draw "
                             "and its own optimizer steps (upstream: int(steps·timestep_fraction), 9 at 10 steps)")
    sampler_sync_every: int | None = Field(None, ge=1, description="the sampling policy is the trained one as of "
                                           "the last multiple of this many optimizer steps (flow_grpo's "
                                           "ref_update_step: 40 for OnlineSFT); None: the current policy samples")
    ties: Literal["all", "first"] = Field("all", description="a group's samples sharing its maximum reward: all "
                                          "trained (upstream's `== max`), or only the first of them")
    min_spread: float | None = Field(None, ge=0, description="a group whose rewards span no more than this trains "
                                     "nothing (None: upstream — a flat group's members all tie at the maximum and train)")


def best_of_group(rewards: np.ndarray, group_ids: np.ndarray, ties: str = "all",
                  min_spread: float | None = None) -> GroupAdvantages:
    """Each sample's loss weight: 1/G where its reward is its group's maximum (`ties`: all of
    them, or the first), else 0 — upstream's type='sft' weight 1, averaged over a batch of G rows
    per winner; a group spanning no more than `min_spread` trains none. zero_std_ratio: the share
    of groups whose rewards are all equal."""
    rewards, group_ids = checked_rewards(rewards, group_ids)
    adv = np.zeros(len(rewards), dtype=np.float32)
    groups = list(dict.fromkeys(group_ids.tolist()))
    flat = 0
    for g in groups:
        idx = np.flatnonzero(group_ids == g)
        r = rewards[idx]
        flat += bool(np.all(r == r[0]))
        if min_spread is not None and r.max() - r.min() <= min_spread:
            continue
        best = idx[r == r.max()]
        adv[best if ties == "all" else best[:1]] = 1.0 / len(idx)
    return GroupAdvantages(advantages=adv, zero_std_ratio=flat / max(1, len(groups)), keep=adv != 0)


@register_algorithm("online_sft")
class OnlineSFT(Algorithm):
    Settings = OnlineSFTSettings
    needs = frozenset({"final_latent"})

    def __init__(self, cfg):
        super().__init__(cfg)
        self.separate_sampler = self.settings.sampler_sync_every is not None
        self.load_state(None)

    @property
    def needs_reference(self) -> bool:
        return False

    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        if step != "denoise":
            raise ValueError("algorithm 'online_sft' trains flow-matching (denoise) families; token families: token_sft")
        if sampling.window_size:
            raise ValueError("algorithm 'online_sft' stores no transitions (it trains on final latents); unset "
                             "sampling.window_size")

    def rollout_recipe(self, sampling: SamplingConfig, rng: np.random.Generator, step: str,
                       iteration: int) -> SamplerRecipe:
        """The sampling config's kernel and noise at every step (as flow_grpo samples), nothing stored."""
        return SamplerRecipe(sampling.steps, sampling.noise_level, sampling.sde_type, sampling.guidance_scale,
                             None, ())

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        return best_of_group(rewards, group_ids, self.settings.ties, self.settings.min_spread)

    def trains_on(self, advantages: np.ndarray, group_ids: np.ndarray | None = None) -> np.ndarray:
        return np.asarray(advantages) != 0

    @property
    def passes(self) -> int:
        """One round over the winners per noise draw, each its own optimizer steps, as upstream
        steps the optimizer inside its loop over `train_timesteps`."""
        return self.settings.noise_draws

    def losses(self, batch, policy):
        """One noise draw of the micro-batch's winners (a pass's generator: each pass draws anew)."""
        x0 = policy.tensor(batch["final_latent"])
        weight = policy.tensor(np.asarray(batch["advantage"], dtype=np.float32))
        fam = policy.model
        sigma = draw_noise_levels(len(x0), self.settings, policy)
        noise = torch.randn(x0.shape, generator=policy.generator, device=policy.device)
        x, target = noised(x0, noise, sigma)
        v = fam.velocity(x.to(fam.dtype), model_timesteps(fam, sigma), policy.cond, conditional_scale(fam, policy.recipe))
        err = prediction_error(fam, v, target, sigma)
        with torch.no_grad():
            metrics = {"err_w": err.mean(), "sigma_mean": sigma.mean()}
        yield (weight * err).mean(), metrics

    # --- the sampling policy: the trained weights as of the last sync ------------------------------
    def sampling_weights(self) -> dict[str, torch.Tensor] | None:
        return self._sampler

    def set_sampling_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self._sampler = weights

    def end_of_update(self, weights: dict[str, torch.Tensor], optimizer_steps: int) -> dict[str, float]:
        n = self.settings.sampler_sync_every
        before, self._step = self._step, self._step + optimizer_steps
        synced = n is not None and before // n != self._step // n
        if synced:
            self._sampler = {k: w.detach().clone() for k, w in weights.items()}
        return {"sft/sampler_synced": float(synced)} if n is not None else {}

    def state(self) -> dict:
        return {"sampler": None if self._sampler is None else {k: v.detach().cpu() for k, v in self._sampler.items()},
                "step": self._step}

    def load_state(self, state: dict | None) -> None:
        self._sampler, self._step = (None, 0) if state is None else (state["sampler"], int(state["step"]))
