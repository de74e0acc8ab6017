"""CRD — Centered Reward Distillation (Zhu, Wang, Lathuilière, Kalogeiton 2026, arXiv 2603.14128;
docs/algorithms/crd.md): KL-regularised reward maximisation on the forward process, where the
intractable normaliser cancels by centering within each prompt's group.

Rollouts: the deterministic ODE of a *sampling* snapshot θ_s (decoupled from the moving
reference), at sampling.guidance_scale; only the final latent is stored. Advantages: per-prompt
GRPO ones (global std by default), clipped at ±m and mapped to a = clip(A, ±m)/m/2 + ½ ∈ [0, 1].

Update, per micro-batch (whole groups) on `train_timesteps` grid levels (AWM's time types), fresh
ε per sample, x_t = (1 − t)·x0 + t·ε, target u = ε − x0, the velocity at the rollout's guidance:

    r_θ   = −mean [(v_θ − u)²/w_θ − (v_old − u)²/w_old]       (w: sg mean |v − u| ∨ 1e-5, adaptive_logp)
    Rc_i  = a_i − mean_{g(i)} a        R_i = r_θ,i − sg(mean_{g(i)} r_θ)      (within-prompt centering)
    L     = m/β · mean (β·R − Rc)²   (mse; bce: BCE-with-logits(β·R, σ(Rc)))
          + kl_weight · mean_B c_i·mean (v_θ − v_ref)²,  c_i = κ + a_i·(1 − κ), κ = 1e-4/kl_weight
            (reward_adaptive_kl; else c = 1); v_ref: the base, guided at kl_guidance with the
            negative prompt (the CFG-guided pretrained model, also after a CFG-free rollout)

`weight_temp` ≥ 0 centres twice — on the softmax(±a/T)-weighted means (T = 0: the positive /
negative samples only) — and averages the two losses. v_old is the "old" snapshot (θ_old; the base
with use_old_for_loss false). After each update both snapshots follow the weights:
θ ← d·θ + (1 − d)·θ_now, d = min(start + slope·(step − at), end) from step `at` (start before),
step = the run's optimizer steps so far. Both are the algorithm's state, saved with the optimizer
state of every checkpoint; the published policy is the trained weights.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from ..config.schema import SamplingConfig
from .awm import AWMSettings, draw_levels, level_sample
from .base import register_algorithm
from .ode_group import ODEGroupAlgorithm, ODEGroupSettings
from .dgpo import check_whole_groups, whole_groups
from .diffusion_nft import optimality
from .weight_average import blend, on_host

Schedule = tuple[float, float, float, float]  # (from step, value before and at it, slope, end value)


class CRDSettings(ODEGroupSettings):
    beta: float = Field(1.0, gt=0, description="β: the implicit reward's scale against the centred external one")
    loss_type: Literal["mse", "bce"] = "mse"
    weight_temp: float = Field(-1.0, description="< 0: plain centering; ≥ 0: two softmax(±a/T)-weighted centres")
    adaptive_logp: bool = Field(True, description="each error over its own detached mean |v − u|")
    use_old_for_loss: bool = Field(True, description="r_θ against the old snapshot (false: the base)")
    old_decay: Schedule = Field((0, 0.25, 0.005, 0.999), description="the old snapshot's EMA schedule")
    sampling_decay: Schedule = Field((75, 0.0, 0.0075, 0.999), description="the sampling snapshot's EMA schedule")
    kl_weight: float = Field(0.1, ge=0, description="weight of the velocity KL to the (guided) base")
    kl_guidance: float = Field(4.5, ge=1.0, description="the base's CFG scale in the KL (kl_cfg), with "
                               "sampling.negative_prompt; 1: unguided")
    reward_adaptive_kl: bool = Field(True, description="the KL per sample scaled by κ + a·(1 − κ)")
    train_timesteps: int = Field(0, ge=0, description="levels per micro-batch; 0: int(steps·timestep_fraction)")
    timestep_fraction: float = Field(0.99, gt=0, le=1)
    time_type: Literal["discrete_wo_init", "discrete", "discrete_with_init", "uniform", "logit_normal"] = "discrete"
    time_shift: float = Field(3.0, gt=0)


def schedule_decay(step: int, spec: Schedule) -> float:
    at, start, slope, end = spec
    return float(start) if step < at else float(min(start + (step - at) * slope, end))


def implicit_reward(v, v_old, target, adaptive: bool) -> torch.Tensor:
    """r_θ per sample: −mean [(v − u)²/w − (v_old − u)²/w_old], w = sg mean |· − u| ∨ 1e-5 (fp64)."""
    dims = tuple(range(1, v.ndim))
    err, err_old = (v - target) ** 2, (v_old - target) ** 2
    if adaptive:
        with torch.no_grad():
            w = (v.double() - target.double()).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
            w_old = (v_old.double() - target.double()).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
        err, err_old = err / w, err_old / w_old
    return -(err - err_old).mean(dim=dims)


def _centred(values: torch.Tensor, weights: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """values − the weighted mean of each row's group (weights normalised within each group)."""
    n = int(groups.max()) + 1
    mass = torch.zeros(n, dtype=weights.dtype, device=weights.device).scatter_add_(0, groups, weights)
    total = torch.zeros(n, dtype=values.dtype, device=values.device).scatter_add_(0, groups, weights * values)
    return values - (total / mass)[groups]


def _group_softmax(logits: torch.Tensor, groups: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax within each group, over the rows in `mask` (a group with none of them: uniform)."""
    out = torch.zeros_like(logits)
    for g in groups.unique():
        rows = groups == g
        sel = rows if mask is None else rows & mask
        if not bool(sel.any()):
            out[rows] = 1.0 / int(rows.sum())
            continue
        out[rows] = torch.softmax(logits.masked_fill(~sel, float("-inf"))[rows], dim=0)
    return out


def crd_loss(a: torch.Tensor, r: torch.Tensor, groups: torch.Tensor, s: CRDSettings) -> torch.Tensor:
    """The centred reward-matching loss (before the m/β scale): one centre per group, or two
    (the softmax(±a/T)-weighted means; T = 0: the above- / below-average samples) averaged."""
    def match(weights):
        rc = _centred(a, weights, groups)
        r_c = r - (r.detach() - _centred(r.detach(), weights, groups))  # r − sg(weighted mean of r)
        if s.loss_type == "bce":
            return F.binary_cross_entropy_with_logits(s.beta * r_c, torch.sigmoid(rc.detach()))
        return ((s.beta * r_c - rc) ** 2).mean()

    if s.weight_temp < 0:
        return match(torch.ones_like(a))
    if s.weight_temp == 0:
        plus, minus = _group_softmax(a, groups, a > 0.5), _group_softmax(a, groups, a < 0.5)
    else:
        plus, minus = _group_softmax(a / s.weight_temp, groups), _group_softmax(-a / s.weight_temp, groups)
    return 0.5 * match(plus) + 0.5 * match(minus)


@register_algorithm("crd")
class CRD(ODEGroupAlgorithm):
    Settings = CRDSettings
    needs = frozenset({"final_latent"})
    separate_sampler = True  # the sampling snapshot θ_s

    def __init__(self, cfg):
        super().__init__(cfg)
        self.load_state(None)

    @property
    def needs_reference(self) -> bool:
        return self.settings.kl_weight > 0 or not self.settings.use_old_for_loss

    @property
    def guides_reference(self) -> bool:
        return self.settings.kl_weight > 0 and self.settings.kl_guidance > 1

    def check_family(self, family, model=None) -> None:
        if self.guides_reference and getattr(family, "guidance", "cfg") != "cfg":
            raise ValueError(f"algorithm.kl_guidance={self.settings.kl_guidance} guides the KL's base model with a "
                             f"negative prompt, and the {family.name} family is guidance-distilled (no negative prompt "
                             f"is encoded): set algorithm.kl_guidance=1")

    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        super().check_sampling(sampling, step)
        check_whole_groups(sampling, "crd", "centres each sample's rewards within its prompt's group")

    def _levels(self, grid: int) -> AWMSettings:
        c = self.settings
        n = c.train_timesteps or max(1, int(grid * c.timestep_fraction))
        return AWMSettings(train_timesteps=n, timestep_fraction=c.timestep_fraction, time_type=c.time_type,
                           time_shift=c.time_shift)

    def terms(self, batch, trained_steps: frozenset[int] | None = None) -> int:
        return self._levels(len(batch["timesteps"][0])).train_timesteps

    def losses(self, batch, policy):
        c, fam = self.settings, policy.model
        x0 = policy.tensor(batch["final_latent"]).float()
        a = optimality(policy.tensor(batch["advantage"]), c.adv_clip_max)
        groups, _ = whole_groups(np.asarray(batch["group_id"]), x0.device)
        levels = self._levels(len(policy.timesteps))
        draws, on_grid = draw_levels(levels, len(policy.timesteps), len(x0), policy.generator)
        old = policy.frozen["old"] if c.use_old_for_loss else policy.reference
        g = policy.recipe.guidance_scale  # the rollout's (a guidance-distilled family: its embedded scale)
        neg = policy.neg if g > 1 and getattr(fam, "guidance", "cfg") == "cfg" else None
        dims = tuple(range(1, x0.ndim))
        for j in range(levels.train_timesteps):
            t, timestep, x_t, target = level_sample(policy, draws, on_grid, j, x0)
            x_t = x_t.to(fam.dtype)
            v = fam.velocity(x_t, timestep, policy.cond, g, neg).float()
            with torch.no_grad():
                v_old = old.velocity(x_t, timestep, policy.cond, g, neg).float()
            r = implicit_reward(v, v_old, target, c.adaptive_logp)
            loss = crd_loss(a, r, groups, c) * c.adv_clip_max / c.beta
            metrics = {"policy_loss": loss.detach(), "crd/implicit_reward": r.detach().mean(), "crd/t": t.mean(),
                       "old_deviate": ((v.detach() - v_old) ** 2).mean()}
            if c.kl_weight > 0:
                guided = self.guides_reference
                with torch.no_grad():
                    v_ref = policy.reference.velocity(x_t, timestep, policy.cond, c.kl_guidance if guided else g,
                                                      policy.neg if guided else neg).float()
                kl = ((v - v_ref) ** 2).mean(dim=dims)
                kappa = 1e-4 / c.kl_weight
                coef = kappa + a * (1 - kappa) if c.reward_adaptive_kl else torch.ones_like(a)
                loss = loss + c.kl_weight * (coef * kl).mean()
                metrics["kl"] = kl.detach().mean()
            yield loss, metrics

    # --- the old and sampling snapshots: the algorithm's state ----------------------------------
    def frozen_slots(self) -> tuple[str, ...]:
        return ("old",) if self.settings.use_old_for_loss else ()

    def frozen_weights(self, name: str, start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._old is None:  # both snapshots start at the weights of the first update
            self._old = {k: v.detach().clone() for k, v in start.items()}
        return self._old

    def sampling_weights(self) -> dict[str, torch.Tensor] | None:
        return self._sampling

    def set_sampling_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self._sampling = weights

    def end_of_update(self, weights: dict[str, torch.Tensor], optimizer_steps: int) -> dict[str, float]:
        self._step += optimizer_steps
        c = self.settings
        d_old, d_s = schedule_decay(self._step, c.old_decay), schedule_decay(self._step, c.sampling_decay)
        if c.use_old_for_loss:
            self._old = blend(self._old, weights, d_old)
        self._sampling = blend(self._sampling, weights, d_s)
        return {"crd/old_decay": d_old, "crd/sampling_decay": d_s}

    def state(self) -> dict:
        return {"old": on_host(self._old), "sampling": on_host(self._sampling), "step": self._step}

    def load_state(self, state: dict | None) -> None:
        if state is None:
            self._old, self._sampling, self._step = None, None, 0
        else:
            self._old, self._sampling, self._step = state["old"], state["sampling"], int(state["step"])
