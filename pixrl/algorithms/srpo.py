"""SRPO (Shen et al., arXiv 2509.06942; Tencent-Hunyuan/SRPO, `fastvideo/SRPO.py`; algorithms.md
§6.3): Direct-Align with Semantic Relative Preference. Not a policy gradient: a reward model's
gradient flows into the policy through a one-step recovery of its own sample from injected noise.

Rollouts: the deterministic ODE on the family's grid at sampling.guidance_scale; only the final
latent x0 is stored, and its initial noise ε is the row's seed's (drawn again in the update as the
sampler drew it) — SRPO injects the very noise the sample came from.

Update, per sample, on N = `timestep_length` noise levels σ_l spread linearly between the
`train_window` steps (a, b) of the family's own σ grid of `grid_steps` steps: a level m ~ U{5 … N−5}
and a gap k = min(int((1 − groundtruth_ratio)·N) + 1, N − m, m); one loss term per branch:

    denoise:    σ_hi = σ_l[N − min(m + k, N)],  σ_lo = σ_l[N − m]
                x = σ_hi·ε + (1 − σ_hi)·x0,  x' = x + (σ_lo − σ_hi)·v_θ(x, σ_hi),  x̂0 = (x' − σ_lo·ε)/(1 − σ_lo)
                s = SRP(x̂0; pos, neg, d_pos[m])
    inversion:  m' = max(m − k, 1),  σ_lo = σ_l[N − m'],  σ_hi = σ_l[N − min(m' + k, N)]
                x = σ_lo·ε + (1 − σ_lo)·x0,  x' = x + (σ_hi − σ_lo)·v_θ(x, σ_lo),  x̂0 = (x' − σ_hi·ε)/(1 − σ_hi)
                s = SRP(x̂0; neg, pos, d_inv[m'])
    L = mean_B relu(threshold − s)                                   (ReFL's threshold, 0.7)

    SRP(x̂0; a, b, d) = c · e_img(decode(x̂0)) · ((1 + d)·e_txt(a) − e_txt(b))

with L2-normalised embeddings of the reward model (`reward`, one of the run's rewards), c its
scale (HPSv2: 1; CLIP, PickScore: exp(logit_scale)/20), pos / neg the prompt behind a positive /
negative control word ("Real. <prompt>", "Painting. <prompt>"), d_pos = linspace(0.1, 0.25, N),
d_inv = linspace(0.3, 0.01, N). The decode and the reward's image preprocessing are tensor
operations, so the gradient reaches the velocity.

Where pixrl departs from SRPO.py, and why: the levels come from the family's own σ grid (SRPO's
FLUX run: a static shift 3 on 50 steps — set model.shift where the scheduler has a fixed one);
the model reads σ·1000 exactly (SRPO truncates to integer thousandths); m and the control words are
drawn per sample from the update's seeded generator (SRPO: one m per step, words cycling with the
step), so an update is a function of its rows and replays bit for bit.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..config.schema import SamplingConfig
from .advantages import GroupAdvantages, group_advantages
from .base import Algorithm, register_algorithm
from .recipe import ode_recipe
from .reward_gradient import bound_reward, check_gradient_family, check_gradient_reward
from .sampling import SamplerRecipe, generators, initial_noise, model_timesteps

POSITIVE_WORDS = ["Natural-lighting", "Detail", "Detailed", "Real"]  # SRPO.py's realism adjectives
NEGATIVE_WORDS = ["Concept art", "Painting", "Anime", "Flat", "Oil"]  # its "AI-look" ones


class SRPOSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: str = Field("hpsv2", description="the reward whose gradient trains: one of reward.weights with a "
                                             "differentiable image path (hpsv2, pickscore, clip_score)")
    positive_words: list[str] = Field(default_factory=lambda: list(POSITIVE_WORDS), min_length=1)
    negative_words: list[str] = Field(default_factory=lambda: list(NEGATIVE_WORDS), min_length=1)
    control_template: str = Field("{word}. {prompt}", description="how a control word joins the prompt")
    grid_steps: int = Field(50, ge=2, description="steps of the family's σ grid the levels are spread on "
                                                  "(SRPO's vis_sampling_step)")
    train_window: tuple[int, int] = Field((5, 25), description="the grid steps (a, b) between which the N levels lie")
    timestep_length: int = Field(1000, ge=11, description="N, the levels between the window's ends")
    groundtruth_ratio: float = Field(0.965, gt=0, lt=1, description="sets the gap k = int((1 − ratio)·N) + 1")
    discount_pos: tuple[float, float] = (0.1, 0.25)
    discount_inv: tuple[float, float] = (0.3, 0.01)
    threshold: float = Field(0.7, description="ReFL's: the loss is relu(threshold − SRP score)")
    branches: Literal["both", "denoise"] = Field("both", description="the inversion branch too (SRPO), or not")
    train_guidance: float | None = Field(None, ge=1.0, description="embedded guidance of the training forward "
                                         "(SRPO's FLUX: rollouts at 1, training at 3.5); None: the rollout's")

    @model_validator(mode="after")
    def _window(self):
        a, b = self.train_window
        if not 0 <= a < b < self.grid_steps:
            raise ValueError(f"train_window={self.train_window}: two grid steps 0 ≤ a < b < grid_steps={self.grid_steps}")
        if "{prompt}" not in self.control_template or "{word}" not in self.control_template:
            raise ValueError(f"control_template={self.control_template!r} must hold {{word}} and {{prompt}}")
        return self


def srp_scores(img: torch.Tensor, first: torch.Tensor, second: torch.Tensor, d: torch.Tensor,
               scale: float) -> torch.Tensor:
    """c · e_img · ((1 + d)·e_first − e_second) per sample [B] (embeddings [B, D], d [B])."""
    return scale * (img * ((1 + d)[:, None] * first - second)).sum(-1)


def recovered_x0(x0: torch.Tensor, eps: torch.Tensor, start: torch.Tensor, end: torch.Tensor, velocity) -> torch.Tensor:
    """Direct-Align: noise the sample to σ = start with its own ε, one Euler step of the model's
    velocity to σ = end, then remove end·ε analytically: x̂0 = (x' − end·ε)/(1 − end)."""
    s, e = (v.reshape(-1, *([1] * (x0.ndim - 1))) for v in (start, end))
    x = s * eps + (1 - s) * x0
    return (x + (e - s) * velocity(x, start) - e * eps) / (1 - e)


@register_algorithm("srpo")
class SRPO(Algorithm):
    Settings = SRPOSettings
    needs = frozenset({"final_latent", "seed"})

    def __init__(self, cfg):
        super().__init__(cfg)
        self._rewards = None

    # --- what it can train, checked before a run --------------------------------------------------
    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        if step != "denoise":
            raise ValueError("algorithm 'srpo' trains flow-matching (denoise) families")
        if sampling.max_rounds > 1:
            raise ValueError("algorithm 'srpo' trains every sample (no advantage: the reward's gradient); set "
                             "sampling.max_rounds=1")

    def check_family(self, family, model=None) -> None:
        check_gradient_family("srpo", family)
        sigmas = getattr(model, "sigmas", None)
        if sigmas is not None and len(sigmas) != self.settings.grid_steps:
            raise ValueError(f"model.sigmas holds {len(sigmas)} noise levels, and srpo spreads its levels on the "
                             f"family's grid of algorithm.grid_steps={self.settings.grid_steps}: set "
                             f"algorithm.grid_steps={len(sigmas)} and algorithm.train_window within it")
        if self.settings.train_guidance is not None and getattr(family, "guidance", "cfg") != "embedded":
            raise ValueError(f"algorithm.train_guidance={self.settings.train_guidance}: the {family.name} family's "
                             f"guidance is {getattr(family, 'guidance', 'cfg')} (the rollout's negative batch sets "
                             f"it); unset it — it is for embedded-guidance families (FLUX.1)")

    def check_rewards(self, rewards) -> None:
        from ..rewards.base import REWARDS
        from ..rewards.clip_backbone import PixelGradientReward

        able = sorted(n for n in REWARDS.names() if issubclass(REWARDS.get(n), PixelGradientReward))
        check_gradient_reward("srpo", self.settings.reward, rewards, able)

    def bind_rewards(self, rewards) -> None:
        self._rewards = rewards

    # --- rollouts and update ----------------------------------------------------------------------
    def rollout_recipe(self, sampling: SamplingConfig, rng: np.random.Generator, step: str,
                       iteration: int) -> SamplerRecipe:
        return ode_recipe(sampling)

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        """Flow-GRPO's group advantages, stored for comparison with the policy-gradient runs; the
        loss reads none (the reward model's gradient replaces them)."""
        return group_advantages(rewards, group_ids, False, 1e-4, 5.0)

    def terms(self, batch, trained_steps: frozenset[int] | None = None) -> int:
        return 2 if self.settings.branches == "both" else 1

    def losses(self, batch, policy):
        c, fam = self.settings, policy.model
        reward = self._reward()
        x0 = policy.tensor(batch["final_latent"]).float()
        n, gen = c.timestep_length, policy.generator
        eps = initial_noise(generators(list(batch["seed"]), fam.device), tuple(x0.shape[1:])).to(x0.device)
        levels = self._levels(fam)
        mid, gap, pos, neg = self.draws(list(batch["prompt"]), gen)
        text = {"pos": reward.embed_texts(pos), "neg": reward.embed_texts(neg)}
        g = c.train_guidance if c.train_guidance is not None else policy.recipe.guidance_scale

        def velocity(x, sigma):
            t = model_timesteps(fam, sigma)
            return fam.velocity(x.to(fam.dtype), t, policy.cond, g, policy.neg).float()

        for branch in ("denoise", "inversion")[:self.terms(batch)]:
            m = mid if branch == "denoise" else torch.clamp(mid - gap, min=1)
            hi, lo = levels[n - torch.clamp(m + gap, max=n)].to(x0.device), levels[n - m].to(x0.device)
            start, end = (hi, lo) if branch == "denoise" else (lo, hi)
            x0_hat = recovered_x0(x0, eps, start, end, velocity)
            img = reward.embed_pixels(fam.decode_pixels(x0_hat))
            ends = (c.discount_pos if branch == "denoise" else c.discount_inv)
            d = torch.linspace(ends[0], ends[1], n)[m].to(img.device)
            first, second = (text["pos"], text["neg"]) if branch == "denoise" else (text["neg"], text["pos"])
            s = srp_scores(img, first, second, d, reward.srp_scale())
            loss = torch.relu(c.threshold - s).mean()
            yield loss, {f"srpo/{branch}_score": s.mean().detach(), f"srpo/{branch}_sigma": start.float().mean(),
                         f"srpo/{branch}_gap": (end - start).abs().float().mean()}

    def _reward(self):
        return bound_reward("srpo", self._rewards, self.settings.reward)

    def _levels(self, fam) -> torch.Tensor:
        """σ_l: N levels from the window's first grid step's σ to its last's, linearly."""
        a, b = self.settings.train_window
        sigmas, _ = fam.schedule(self.settings.grid_steps)
        return torch.linspace(float(sigmas[a]), float(sigmas[b]), self.settings.timestep_length)

    def draws(self, prompts: list[str], gen: torch.Generator):
        """The update's randomness for these rows, from its seeded generator: each sample's level m
        ~ U{5 … N−5}, its gap k, and its prompt behind a drawn positive and a drawn negative word."""
        c, n = self.settings, self.settings.timestep_length
        mid = torch.randint(5, n - 4, (len(prompts),), generator=gen, device=gen.device).cpu()
        gap = torch.clamp(torch.minimum(n - mid, mid), max=int((1 - c.groundtruth_ratio) * n) + 1)
        i = torch.randint(len(c.positive_words), (len(prompts),), generator=gen, device=gen.device).tolist()
        j = torch.randint(len(c.negative_words), (len(prompts),), generator=gen, device=gen.device).tolist()
        pos = [c.control_template.format(word=c.positive_words[a], prompt=p) for a, p in zip(i, prompts)]
        neg = [c.control_template.format(word=c.negative_words[a], prompt=p) for a, p in zip(j, prompts)]
        return mid, gap, pos, neg

