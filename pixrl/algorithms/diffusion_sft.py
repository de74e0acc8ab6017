"""Supervised fine-tuning on the preferred samples of archived rollouts: the flow-matching loss on
each pair's winner — Diffusion-DPO's own SFT baseline (its `--sft`: "plain MSE on the preferred
images", algorithms.md §9.1) and, with one pair per group (dpo=best_worst), reward-ranked
fine-tuning on each prompt group's best sample.

Per winner x0_w: σ drawn as the model's training schedule draws it (the same law as Diffusion-DPO,
`draw_noise_levels`), fresh ε, x_σ = (1−σ)·x0_w + σ·ε, and L = mean_B mean_CHW ‖(ε − x0_w) −
v_θ(x_σ, σ, c)‖² (a DDPM family's own ε or v error: `prediction_error`); a guidance-distilled
family's forward at the scale the archived rollouts were sampled at (`stages.offline.training_recipe`).
No reference model: nothing holds the policy near the base but the learning rate and the number
of steps. Losers are read with the pairs (the offline stage layer's micro-batch is b winners then
their b losers) and ignored.
"""

from __future__ import annotations

import torch

from .base import Algorithm, register_algorithm
from .diffusion_dpo import NoiseLevelSettings, draw_noise_levels, noised, prediction_error
from .sampling import conditional_scale, model_timesteps


class SFTSettings(NoiseLevelSettings):
    """SFT's keys of the `algorithm` section: how σ is drawn (where the samples come from is `dpo`)."""


@register_algorithm("diffusion_sft")
class DiffusionSFT(Algorithm):
    Settings = SFTSettings
    needs = frozenset({"final_latent"})
    offline = True

    @property
    def needs_reference(self) -> bool:
        return False

    def losses(self, batch, policy):
        x0 = policy.tensor(batch["final_latent"])
        b = len(x0) // 2
        x_w = x0[:b]
        sigma = draw_noise_levels(b, self.settings, policy)
        noise = torch.randn(x_w.shape, generator=policy.generator, device=policy.device)
        x, target = noised(x_w, noise, sigma)
        cond = policy.cond.select(list(range(b)))  # the winners' rows
        g = conditional_scale(policy.model, policy.recipe)  # a distilled family's archived embedded scale
        err = prediction_error(policy.model, policy.model.velocity(x.to(policy.model.dtype),
                                                                   model_timesteps(policy.model, sigma), cond, g),
                               target, sigma)
        with torch.no_grad():
            metrics = {"err_w": err.mean(), "sigma_mean": sigma.mean()}
        yield err.mean(), metrics
