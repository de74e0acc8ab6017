"""Builds the sampler recipe for an iteration from the sampling config.

Plain Flow-GRPO: every step is stochastic and the first int(T · timestep_fraction) transitions
are trained (9 of 10: the last step to σ = 0 is excluded — its Gaussian is very sharp).
Flow-GRPO-Fast: one window of W SDE steps inside window_range, drawn once per iteration from
the run seed (so all members of a group share it); the other steps are ODE. With
window_shape=scattered the W steps are drawn anywhere in window_range (UniRL's FLUX.2-klein recipe:
3 of the first 5 of 10 steps).
Token families: the logit transform (guidance weight, temperature, top-k), the same in rollout,
replay and evaluation.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from ..config.schema import SamplingConfig
from .sampling import SamplerRecipe
from .token_sampling import TokenRecipe


def token_recipe(s: SamplingConfig) -> TokenRecipe:
    """The logit transform, and the chain of thought when one is asked for."""
    cot = (s.cot_tokens, s.cot_temperature, s.cot_template) if s.cot_tokens else (0, 1.0, "")
    return TokenRecipe(s.guidance_scale, s.temperature, s.top_k, *cot)


def window_bounds(s: SamplingConfig) -> tuple[int, int]:
    """[lo, hi) that an SDE window is drawn within (that it fits is checked with the config)."""
    lo, hi = s.window_range or (0, s.steps // 2)
    return lo, hi


def trained_step_count(s: SamplingConfig) -> int:
    """Without a window: the first int(T · timestep_fraction) transitions are trained."""
    return max(1, int(s.steps * s.timestep_fraction))


def rollout_recipe(s: SamplingConfig, rng: np.random.Generator, step: str = "denoise") -> SamplerRecipe | TokenRecipe:
    if step == "token":
        return token_recipe(s)
    if s.window_size:
        lo, hi = window_bounds(s)
        if s.window_shape == "scattered":
            window = tuple(sorted(int(k) for k in rng.choice(np.arange(lo, hi), s.window_size, replace=False)))
        else:
            start = int(rng.integers(lo, hi - s.window_size + 1))
            window = tuple(range(start, start + s.window_size))
        return SamplerRecipe(s.steps, s.noise_level, s.sde_type, s.guidance_scale, window, window)
    return SamplerRecipe(s.steps, s.noise_level, s.sde_type, s.guidance_scale, None,
                         tuple(range(trained_step_count(s))))


def eval_recipe(s: SamplingConfig, step: str = "denoise") -> SamplerRecipe | TokenRecipe:
    """Deterministic ODE sampling for evaluation (noise level 0, eval_steps); a token family
    samples with the rollout's transform (its policy is the categorical distribution itself)."""
    if step == "token":
        return token_recipe(s)
    return with_guidance(SamplerRecipe(s.eval_steps, 0.0, "sde", s.guidance_scale, None, ()), s)


def with_guidance(recipe: SamplerRecipe | TokenRecipe, s: SamplingConfig) -> SamplerRecipe | TokenRecipe:
    """A recipe with the run's classifier-free guidance settings beyond the scale — its negative
    prompt and CFG truncation — which every algorithm's rollouts sample with (a token family's
    recipe has neither: preflight refuses them there)."""
    if not isinstance(recipe, SamplerRecipe):
        return recipe
    return replace(recipe, negative_prompt=s.negative_prompt, cfg_truncation=s.cfg_truncation)


def ode_recipe(s: SamplingConfig, solver: str = "euler") -> SamplerRecipe:
    """The policy's deterministic ODE at the run's guidance, nothing but the final latents stored:
    the rollouts of the forward-process algorithms (AWM, DGPO, SRPO, online DPO)."""
    return with_guidance(SamplerRecipe(s.steps, 0.0, "sde", s.guidance_scale, (), (), ode_solver=solver), s)


def stored_recipe(rec: dict, step: str, train_cfg: bool = True) -> SamplerRecipe | TokenRecipe:
    """The recipe a rollout recorded (its row's `recipe` JSON), for replaying it; without
    train_cfg the replay drops guidance (the conditional policy only, as T2I-R1 trains)."""
    if step == "token":
        return TokenRecipe(rec["guidance_scale"] if train_cfg else 1.0, rec["temperature"], rec["top_k"],
                           rec.get("cot_tokens", 0), rec.get("cot_temperature", 1.0), rec.get("cot_template", ""))
    return SamplerRecipe(rec["steps"], rec["noise_level"], rec["sde_type"],
                         rec["guidance_scale"] if train_cfg else 1.0,
                         tuple(rec["sde_steps"]) if rec["sde_steps"] is not None else None,
                         tuple(rec["train_steps"]), shared_noise=rec.get("shared_noise", False),
                         shared_members=rec.get("shared_members", 0), ode_solver=rec.get("ode_solver", "euler"),
                         tail_compress=rec.get("tail_compress", 1.0), stored_width=rec.get("stored_width", 0),
                         negative_prompt=rec.get("negative_prompt", ""), cfg_truncation=rec.get("cfg_truncation", 1.0))


def replay_recipe(recipe_jsons, step: str, train_cfg: bool = True) -> SamplerRecipe | TokenRecipe:
    """The recipe an update replays an iteration's rows with: their recorded recipe, or, for an
    iteration sampled in parts (`Algorithm.rollout_parts`, e.g. TempFlow-GRPO's branch steps),
    the union of the parts' stochastic and stored steps. The replay step reads only the kernel,
    noise level and guidance, and whether a row's stored step is stochastic, so the union replays
    every part's rows exactly; parts that differ in anything else are refused."""
    recs = [stored_recipe(json.loads(r), step, train_cfg) for r in dict.fromkeys(recipe_jsons)]
    if len(recs) == 1:
        return recs[0]
    if step == "token":
        raise ValueError(f"an iteration's token rollouts carry {len(recs)} different recipes; they share one")
    bare = {replace(r, sde_steps=None, train_steps=(), stored_width=0) for r in recs}
    if len(bare) > 1:
        raise ValueError(f"the rows of one iteration were sampled with recipes that differ beyond their stochastic "
                         f"and stored steps ({len(bare)} kinds); an update replays one kernel, noise level and "
                         f"guidance")
    sde = None if any(r.sde_steps is None for r in recs) else tuple(sorted({k for r in recs for k in r.sde_steps}))
    train = tuple(sorted({k for r in recs for k in r.train_steps}))
    return replace(recs[0], sde_steps=sde, train_steps=train, stored_width=0)
