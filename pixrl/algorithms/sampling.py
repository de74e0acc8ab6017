"""The shared denoise sampler: one loop for every flow-matching family, rollout and eval alike.

A recipe says which steps are stochastic (SDE/CPS with noise level a) and which transitions are
stored for training. Noise is drawn from one torch.Generator per sample (initial latent first,
then one ε per stochastic step), so a sample is reproducible from its seed alone, whatever
batch it ran in. Replay (`replay_log_probs`) runs the very same step function on the stored
transitions, with the same micro-batch composition, so the ratio is exactly 1 before an update.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .flow_sde import StepOut, flow_step


@dataclass(frozen=True)
class SamplerRecipe:
    steps: int = 10
    noise_level: float = 0.7
    sde_type: str = "sde"  # "sde" | "cps"
    guidance_scale: float = 1.0
    sde_steps: tuple[int, ...] | None = None  # stochastic steps; None = all
    train_steps: tuple[int, ...] = ()  # stored transitions (subset of sde_steps)

    def is_sde(self, k: int) -> bool:
        return self.noise_level > 0 and (self.sde_steps is None or k in self.sde_steps)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Trajectory:
    final: torch.Tensor  # [B, C, H, W]
    latents: torch.Tensor  # [B, S, C, H, W] x_k at the stored steps
    next_latents: torch.Tensor  # [B, S, C, H, W] x_{k+1}
    log_probs: torch.Tensor  # [B, S]
    sigmas: torch.Tensor  # [T+1]
    timesteps: torch.Tensor  # [T]
    stored_steps: list[int] = field(default_factory=list)


def generators(seeds: list[int], device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One generator per sample on the model's device (so its noise is drawn where it is used)."""
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


def initial_noise(generators: list[torch.Generator], shape: tuple[int, ...]) -> torch.Tensor:
    """x_T per sample from its own generator (== diffusers randn_tensor with a generator list)."""
    return torch.cat([torch.randn((1, *shape), generator=g, dtype=torch.float32, device=g.device)
                      for g in generators])


_step_noise = initial_noise  # one ε per sample per stochastic step, drawn the same way


def denoise_step(policy, x, k: int, sigmas, timesteps, cond, neg, recipe: SamplerRecipe,
                 prev_sample=None, noise=None) -> StepOut:
    """One step k of the recipe: velocity (with CFG) then the SDE/ODE transition."""
    v = policy.velocity(x.to(policy.dtype), timesteps[k:k + 1], cond, recipe.guidance_scale, neg)
    a = recipe.noise_level if recipe.is_sde(k) else 0.0
    return flow_step(v, x, sigmas[k], sigmas[k + 1], float(sigmas[1]), a, recipe.sde_type,
                     prev_sample=prev_sample, noise=noise)


@torch.no_grad()
def sample(policy, cond, neg, generators: list[torch.Generator], recipe: SamplerRecipe) -> Trajectory:
    """Run the whole schedule for one micro-batch; store the recipe's train_steps transitions."""
    sigmas, timesteps = policy.schedule(recipe.steps)
    shape = policy.latent_shape()
    x = initial_noise(generators, shape)
    stored_x, stored_next, stored_lp = [], [], []
    for k in range(recipe.steps):
        noise = _step_noise(generators, shape) if recipe.is_sde(k) else None
        out = denoise_step(policy, x, k, sigmas, timesteps, cond, neg, recipe, noise=noise)
        if k in recipe.train_steps:
            stored_x.append(x)
            stored_next.append(out.prev_sample)
            stored_lp.append(out.log_prob)
        x = out.prev_sample.float()
    b = x.shape[0]
    empty = torch.zeros((b, 0, *shape), device=x.device)
    return Trajectory(
        final=x,
        latents=torch.stack(stored_x, 1) if stored_x else empty,
        next_latents=torch.stack(stored_next, 1) if stored_next else empty,
        log_probs=torch.stack(stored_lp, 1) if stored_lp else torch.zeros((b, 0), device=x.device),
        sigmas=sigmas, timesteps=timesteps, stored_steps=list(recipe.train_steps))


def replay_step(policy, latents, next_latents, k: int, sigmas, timesteps, cond, neg,
                recipe: SamplerRecipe) -> StepOut:
    """log π_θ(x_{k+1} | x_k) for stored transitions of step k (gradient through the mean)."""
    return denoise_step(policy, latents, k, sigmas, timesteps, cond, neg, recipe, prev_sample=next_latents)
