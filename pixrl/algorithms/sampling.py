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

from ..errors import ExpectedError
from .flow_sde import StepOut, flow_step, vp_norm
from .guidance_memory import GuidanceMemory, memory_for, memory_kwargs
from .ode_solvers import compressed_tail, dpm_step


@dataclass(frozen=True)
class SamplerRecipe:
    steps: int = 10
    noise_level: float = 0.7
    sde_type: str = "sde"  # "sde" | "cps"
    guidance_scale: float = 1.0
    sde_steps: tuple[int, ...] | None = None  # stochastic steps; None = all
    train_steps: tuple[int, ...] = ()  # stored transitions (subset of sde_steps)
    shared_noise: bool = False  # one initial latent per group (DanceGRPO's init_same_noise)
    shared_members: int = 0  # with shared_noise: members g of a group with equal g // shared_members share
    # it, keyed by prompt across the iteration's parts (TempFlow's bases); 0: the whole group, one latent
    ode_solver: str = "euler"  # the deterministic steps after the last stochastic one: "euler" | "dpm2"
    tail_compress: float = 1.0  # MixGRPO-Flash: those steps re-spaced onto this fraction of the points
    stored_width: int = 0  # rows hold this many transitions (padded, step −1), so a run's windows that
    # shrink near the end of the grid (MixGRPO) fit its table; 0: exactly len(train_steps)
    negative_prompt: str = ""  # CFG's unconditional prompt (guidance_scale > 1), encoded by Family.encode_negative
    cfg_truncation: float = 1.0  # CFG only up to this point of the grid (guidance_at), the conditional velocity after

    def is_sde(self, k: int) -> bool:
        return self.noise_level > 0 and (self.sde_steps is None or k in self.sde_steps)

    def padded_steps(self) -> tuple[int, ...]:
        """The stored steps as a row holds them: train_steps, then −1 up to stored_width."""
        pad = max(0, self.stored_width - len(self.train_steps))
        return tuple(self.train_steps) + (-1,) * pad

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Trajectory:
    final: torch.Tensor  # [B, C, H, W]
    latents: torch.Tensor  # [B, S, C, H, W] x_k at the stored steps
    next_latents: torch.Tensor  # [B, S, C, H, W] x_{k+1}
    log_probs: torch.Tensor  # [B, S]
    means: torch.Tensor  # [B, S, C, H, W] μ of each stored transition (GRPO-Guard, Flow-DPPO)
    sigmas: torch.Tensor  # [T+1]
    timesteps: torch.Tensor  # [T]
    stored_steps: list[int] = field(default_factory=list)
    memory: torch.Tensor | None = None  # [B, S, C, H, W] the guider's memory before each stored step (guidance_memory)


def generators(seeds: list[int], device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One generator per sample on the model's device (so its noise is drawn where it is used)."""
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


def initial_noise(generators: list[torch.Generator], shape: tuple[int, ...]) -> torch.Tensor:
    """x_T per sample from its own generator (== diffusers randn_tensor with a generator list)."""
    return torch.cat([torch.randn((1, *shape), generator=g, dtype=torch.float32, device=g.device)
                      for g in generators])


_step_noise = initial_noise  # one ε per sample per stochastic step, drawn the same way


def model_timesteps(policy, sigma: torch.Tensor) -> torch.Tensor:
    """The model timesteps of noise levels σ off the rollout grid (DPO's and SFT's draws, a
    compressed ODE tail): the family's own map (`timesteps_at`, a DDPM family's continuous t),
    else σ·num_train_timesteps, as diffusers' flow-matching schedulers set them."""
    at = getattr(policy, "timesteps_at", None)
    return at(sigma) if at is not None else sigma * float(policy.scheduler.config.num_train_timesteps)


def vp_scale(policy, sigma) -> float:
    """n(σ) for a variance-preserving family (`variance_preserving`: SD1.x/2.x), whose pipeline's
    latents are x_vp: the sampler steps the flow latent n(σ)·x_vp (flow_sde.vp_norm), so its noise
    enters as n(σ0)·ε and its final latent leaves as x/n(σ_T); 1 for a flow-matching family."""
    if not getattr(policy, "variance_preserving", False):
        return 1.0
    return float(vp_norm(torch.as_tensor(sigma, dtype=torch.float32)))


def latent_scales(policy, sigmas: torch.Tensor) -> tuple[float, float]:
    """(the factor of ε in the first flow latent, the divisor that turns the last flow latent into
    the pipeline's latents): the family's own (`latent_scales`: Cosmos's EDM coordinates), else
    n(σ) at each end for a variance-preserving family, else (1, 1)."""
    own = getattr(policy, "latent_scales", None)
    if own is not None:
        return own(float(sigmas[0]), float(sigmas[-1]))
    return vp_scale(policy, sigmas[0]), vp_scale(policy, sigmas[-1])


def guidance_at(policy, recipe: SamplerRecipe, k: int, timestep) -> float:
    """The guidance scale of step k: the family's own schedule of it where its pipeline has one
    (`guidance_schedule`: CogVideoX's dynamic CFG), under CFG truncation (`recipe.cfg_truncation`
    < 1) by the family's pipeline's rule (`cfg_truncation_by`): "step" — Lumina2Pipeline's
    `cfg_trunc_ratio`, no CFG once (k + 1)/steps exceeds it, the default — or "time" —
    ZImagePipeline's `cfg_truncation`, no CFG once 1 − t/1000 exceeds it. Past it the velocity is
    the conditional one."""
    scale = recipe.guidance_scale
    schedule = getattr(policy, "guidance_schedule", None)
    if schedule is not None and scale > 1.0:  # (no CFG batch at a scale of 1, whatever the schedule)
        scale = schedule(scale, timestep, recipe.steps)
    if recipe.cfg_truncation >= 1.0:
        return scale
    if getattr(policy, "cfg_truncation_by", "step") == "time":
        past = (1000.0 - float(timestep)) / 1000.0 > recipe.cfg_truncation
    else:
        past = (k + 1) / recipe.steps > recipe.cfg_truncation
    return 1.0 if past else scale


def conditional_scale(policy, recipe: SamplerRecipe | None) -> float:
    """The scale of a conditional forward (no negative prompt) of the velocity a rollout guided
    with `recipe`: 1 for a CFG family; a guidance-distilled family ("embedded": FLUX.1-dev,
    FLUX.2-dev, HunyuanVideo) takes the scale as an input the rollout gave it, so its conditional
    forward is at the rollout's scale — at 1 it would be a model the rollout never ran."""
    if recipe is None or getattr(policy, "guidance", "cfg") != "embedded":
        return 1.0
    return float(recipe.guidance_scale)


def denoise_step(policy, x, k: int, sigmas, timesteps, cond, neg, recipe: SamplerRecipe,
                 prev_sample=None, noise=None, memory: GuidanceMemory | None = None) -> StepOut:
    """One step k of the recipe: velocity (with CFG; a stateful guider reads and updates
    `memory`) then the SDE/ODE transition."""
    v = policy.velocity(x.to(policy.dtype), timesteps[k:k + 1], cond, guidance_at(policy, recipe, k, timesteps[k]), neg,
                        **memory_kwargs(policy, memory, k))
    a = recipe.noise_level if recipe.is_sde(k) else 0.0
    return flow_step(v, x, sigmas[k], sigmas[k + 1], float(sigmas[1]), a, recipe.sde_type,
                     prev_sample=prev_sample, noise=noise)


def tail_start(recipe: SamplerRecipe) -> int:
    """The first step the ODE solver takes over (after the last stochastic step; 0 when none
    is stochastic); `recipe.steps` when every step is the recipe's own kernel (Euler ODE)."""
    if recipe.ode_solver == "euler":
        return recipe.steps
    if recipe.ode_solver != "dpm2":
        raise ValueError(f"unknown ode_solver {recipe.ode_solver!r}; choose 'euler' or 'dpm2'")
    sde = [k for k in range(recipe.steps) if recipe.is_sde(k)]
    first = max(sde) + 1 if sde else 0
    if any(k >= first for k in recipe.train_steps):
        raise ValueError(f"stored steps {recipe.train_steps} lie after the last stochastic step {first - 1}; "
                         f"the ODE solver's steps carry no log-prob")
    return first


@torch.no_grad()
def sample(policy, cond, neg, generators: list[torch.Generator], recipe: SamplerRecipe,
           noise_generators: list[torch.Generator] | None = None, same_prefix: list[int] | None = None) -> Trajectory:
    """Run the whole schedule for one micro-batch; store the recipe's train_steps transitions.
    `noise_generators` draw the initial latents instead of `generators` (a group's shared seed
    when recipe.shared_noise); the step noise always comes from each sample's own generator.
    `same_prefix[i]`: the first row with row i's prompt and initial latent — such rows take their
    steps before the first stochastic one once (`_shared_prefix`).
    With ode_solver "dpm2" the steps after the last stochastic one are DPM-Solver++(2M) steps
    (on a compressed grid when tail_compress < 1), continuing the data-prediction history."""
    sigmas, timesteps = policy.schedule(recipe.steps)
    shape = policy.latent_shape()
    x = initial_noise(noise_generators or generators, shape)
    start, end = latent_scales(policy, sigmas)
    if start != 1.0:
        x = x * start
    stored_x, stored_next, stored_lp, stored_mean, stored_memory = [], [], [], [], []
    tail = tail_start(recipe)
    prev_x0 = None
    memory = memory_for(policy, recipe)
    first, x = _shared_prefix(policy, x, sigmas, timesteps, cond, neg, recipe, same_prefix, tail, memory)
    for k in range(first, tail):
        noise = _step_noise(generators, shape) if recipe.is_sde(k) else None
        before = memory.snapshot(x) if memory is not None and k in recipe.train_steps else None
        out = denoise_step(policy, x, k, sigmas, timesteps, cond, neg, recipe, noise=noise, memory=memory)
        if k in recipe.train_steps:
            _check_stored(out, k, recipe)
            if before is not None:
                stored_memory.append(before.float())
            stored_x.append(x)
            stored_next.append(out.prev_sample)
            # a deterministic step has no density: its row's log-prob is NaN (DRaFT's stored start latent)
            stored_lp.append(out.log_prob if recipe.is_sde(k) else torch.full_like(out.log_prob, float("nan")))
            stored_mean.append(out.mean)
        if tail < recipe.steps:
            prev_x0 = x.float() - float(sigmas[k]) * out.velocity
        x = out.prev_sample.float()
    if tail < recipe.steps:
        x = _ode_tail(policy, x, tail, prev_x0, sigmas, timesteps, cond, neg, recipe, memory)
    finish = getattr(policy, "final_latents", None)  # what the family's pipeline does last (a held frame put back)
    if finish is not None:
        x = finish(x, cond)
    if end != 1.0:
        x = x / end
    b = x.shape[0]
    empty = torch.zeros((b, 0, *shape), device=x.device)
    return Trajectory(
        final=x,
        latents=torch.stack(stored_x, 1) if stored_x else empty,
        next_latents=torch.stack(stored_next, 1) if stored_next else empty,
        log_probs=torch.stack(stored_lp, 1) if stored_lp else torch.zeros((b, 0), device=x.device),
        means=torch.stack(stored_mean, 1) if stored_mean else empty,
        sigmas=sigmas, timesteps=timesteps, stored_steps=list(recipe.train_steps),
        memory=None if memory is None else torch.stack(stored_memory, 1) if stored_memory else empty)


def _shared_prefix(policy, x, sigmas, timesteps, cond, neg, recipe: SamplerRecipe, same_prefix: list[int] | None,
                   tail: int, memory: GuidanceMemory | None = None) -> tuple[int, torch.Tensor]:
    """(k, x_k): rows that start from one latent with one prompt agree until the first stochastic
    step, so those deterministic steps are taken once per such set, on its first row, and the
    result is given to each of its rows — TempFlow-GRPO's branch prefix, shared as its sampler
    shares it, and the ODE steps before MixGRPO's window. (0, x_0) when no row repeats another.
    (The velocity of a smaller batch can differ from the full batch's in the last bits; the
    rollout stores x_k, and replay reads it, so the ratio stays exactly 1.) A guider's `memory`
    is carried through those steps and given to each row as its latent is."""
    first = next((k for k in range(tail) if recipe.is_sde(k)), 0)
    if same_prefix is None or first == 0 or min(recipe.train_steps, default=first) < first:
        return 0, x
    reps = list(dict.fromkeys(same_prefix))
    if len(reps) == len(same_prefix):
        return 0, x
    xs, cond_r, neg_r = x[reps], cond.select(reps), neg.select(reps) if neg is not None else None
    mem_r = memory.select(reps) if memory is not None else None
    for k in range(first):
        xs = denoise_step(policy, xs, k, sigmas, timesteps, cond_r, neg_r, recipe, memory=mem_r).prev_sample.float()
    at = {r: i for i, r in enumerate(reps)}
    rows = [at[r] for r in same_prefix]
    if memory is not None:
        memory.value = mem_r.select(rows).value
    return first, xs[rows]


class UnstorableStep(ExpectedError, ValueError):
    """A recipe stores a transition whose kernel has no spread on this family's grid."""


def _check_stored(out: StepOut, k: int, recipe: SamplerRecipe) -> None:
    """A stored stochastic transition needs a spread: the DDIM-η step onto σ' = 0 (ᾱ' = 1) is
    deterministic, and a Gaussian log-prob of it is undefined (DDPO never stores one: SD's grid
    ends at ᾱ_0 < 1)."""
    if recipe.is_sde(k) and recipe.sde_type == "ddim" and not bool((out.std > 0).all()):
        raise UnstorableStep(f"step {k} of the rollout grid ends at σ = 0, where the DDIM-η transition is "
                         f"deterministic and has no log-prob; store fewer steps (sampling.timestep_fraction "
                         f"< 1, e.g. {(recipe.steps - 1) / recipe.steps:.2f}, leaves the last one out)")


def grid_shift(config) -> float:
    """The static shift of a flow scheduler's grid: FlowMatchEulerDiscreteScheduler's `shift`, a
    multistep solver's `flow_shift` (UniPC/DPM-Solver with flow sigmas: Wan, SANA, Cosmos-Predict2.5),
    else 1."""
    return float(config.get("shift") or config.get("flow_shift") or 1.0)


def _ode_tail(policy, x, first: int, prev_x0, sigmas, timesteps, cond, neg, recipe: SamplerRecipe,
              memory: GuidanceMemory | None = None) -> torch.Tensor:
    """DPM-Solver++(2M) from step `first` to the grid's end (σ = 0; Cosmos-Predict2's σ_min): on
    the schedule's own points, or (Flash) on the compressed re-shifted grid, whose model timesteps
    are the family's of σ (`model_timesteps`)."""
    if recipe.tail_compress < 1.0 and first > 0:
        if recipe.cfg_truncation < 1.0:
            raise ValueError("sampling.cfg_truncation < 1 counts the grid's steps, and a compressed ODE tail "
                             "(tail_compress < 1, MixGRPO-Flash) re-spaces them; use one or the other")
        grid = compressed_tail(sigmas, first - 1, recipe.tail_compress, grid_shift(policy.scheduler.config))
        steps = model_timesteps(policy, grid[:-1])
    else:
        grid, steps = sigmas[first:], timesteps[first:]
    prev_sigma = float(sigmas[first - 1]) if first > 0 else None
    for i in range(len(grid) - 1):
        v = policy.velocity(x.to(policy.dtype), steps[i:i + 1], cond, guidance_at(policy, recipe, first + i, steps[i]), neg,
                            **memory_kwargs(policy, memory, first + i))
        sigma = float(grid[i])
        x, x0 = dpm_step(x, v, sigma, float(grid[i + 1]), prev_x0, prev_sigma)
        prev_x0, prev_sigma = x0, sigma
    return x


def replay_step(policy, latents, next_latents, k: int, sigmas, timesteps, cond, neg,
                recipe: SamplerRecipe, memory: torch.Tensor | None = None) -> StepOut:
    """log π_θ(x_{k+1} | x_k) for stored transitions of step k (gradient through the mean);
    `memory`: the guider's stored m_{k−1} of those transitions (a family with guidance_memory)."""
    mem = memory_for(policy, recipe)
    if mem is not None:
        if memory is None:
            raise ValueError("this family's guider keeps a memory across steps, and the stored transitions came "
                             "without it (no guidance_memory column): replay rows its own rollout wrote")
        mem.value = memory
    return denoise_step(policy, latents, k, sigmas, timesteps, cond, neg, recipe, prev_sample=next_latents, memory=mem)
