"""DGPO — Direct Group Preference Optimization (Luo et al., ICLR 2026; `Luo-Yihong/DGPO`;
docs/algorithms/dgpo.md): a DPO over groups instead of pairs, on the forward process.

Rollouts: the deterministic ODE (DPM-Solver++(2M)) at sampling.guidance_scale — with CFG, while
training runs the conditional velocity only (DGPO's "rollout with CFG, training without CFG");
only the final latent is stored. Advantages: Flow-GRPO's per-prompt ones, clipped at ±5.

Update, per micro-batch (whole groups only) on `train_levels` grid steps drawn without
replacement from the first `trunc_steps` + 1 of the rollout grid, t = the grid's σ there; one
noise per group and level (`shared_noise`), x_t = (1 − t)·x0 + t·ε:

    ℓ_i   = mean_CHW (ε − x0 − v_θ(x_t, t))²         ℓ_ref,i with the reference (the base)
    w_g   = σ(Σ_{i∈g} A_i·β_dpo·(ℓ_i − ℓ_ref,i)/G)   (detached: the group's DPO sigmoid)
    L     = mean_B w_g(i)·A_i·ℓ_i + kl_weight·mean (v_θ − v_ref)²

— the gradient of −log σ(−Σ A·β·Δ/G) summed over groups, DGPO's "gradient-equivalent" form.
PPO-style DSM clipping: ρ_i = exp(ℓ_old,i − ℓ_i) against the EMA reference θ_ema; a sample whose
ρ left 1 ± clip_range in its advantage's direction contributes no gradient through ℓ_i (and, with
`clip_kl`, none through its KL). θ_ema ← d·θ_ema + (1 − d)·θ after every optimizer step,
d = min(ema_ref_decay, 0.001·step) (step: the run's optimizer steps so far); from
`switch_ema_ref` optimizer steps on the rollouts sample with it; with `use_ema_ref` it replaces
the base as the DGPO loss's reference. It is the algorithm's state, saved with the optimizer
state of every checkpoint; the published policy is θ.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from ..config.schema import SamplingConfig
from .base import register_algorithm
from .ode_group import ODEGroupAlgorithm, ODEGroupSettings
from .sampling import conditional_scale
from .weight_average import blend, on_host


class DGPOSettings(ODEGroupSettings):
    beta_dpo: float = Field(100.0, gt=0, description="the group DPO's β (DGPO's config.train.beta_dpo)")
    train_levels: int = Field(4, ge=1, description="grid steps trained per micro-batch (num_train_timesteps)")
    trunc_steps: int = Field(4, ge=0, description="the levels are drawn from grid steps 0 … trunc_steps")
    shared_noise: bool = Field(True, description="one noise per group and level (use_shared_noise)")
    clip_range: float = Field(1e-2, gt=0, description="PPO-style clip of the DSM ratio to the EMA reference")
    clip_dsm: bool = True
    clip_kl: bool = False
    kl_weight: float = Field(0.02, ge=0, description="weight of mean (v_θ − v_ref)² (DGPO's config.train.beta)")
    kl_guidance: float = Field(1.0, ge=1.0, description="the reference's CFG scale (kl_cfg), with "
                               "sampling.negative_prompt — also when the rollout is CFG-free")
    use_ema_ref: bool = Field(False, description="the DGPO loss's reference: the EMA instead of the base")
    ema_ref_decay: float = Field(0.3, ge=0, lt=1, description="the EMA reference's decay cap")
    switch_ema_ref: int | None = Field(500, ge=0, description="optimizer steps after which rollouts sample with "
                                       "the EMA reference; None: never")


def group_weights(adv: torch.Tensor, dsm: torch.Tensor, ref_dsm: torch.Tensor, groups: torch.Tensor,
                  beta_dpo: float, group_size: int) -> torch.Tensor:
    """w of each sample: σ of its group's Σ A·β·(ℓ − ℓ_ref)/G (groups: [B] indices 0..n−1)."""
    term = adv * beta_dpo * (dsm.detach() - ref_dsm.detach()) / group_size
    sums = torch.zeros(int(groups.max()) + 1, dtype=term.dtype, device=term.device).scatter_add_(0, groups, term)
    return torch.sigmoid(sums)[groups]


def clipped_dsm(dsm: torch.Tensor, old_dsm: torch.Tensor, adv: torch.Tensor, clip_range: float):
    """ℓ detached where ρ = exp(ℓ_old − ℓ) left 1 ± c in A's direction; and that mask."""
    ratio = torch.exp(old_dsm.detach() - dsm.detach())
    clip = torch.where(adv > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    return torch.where(clip, dsm.detach(), dsm), clip


@register_algorithm("dgpo")
class DGPO(ODEGroupAlgorithm):
    Settings = DGPOSettings
    needs = frozenset({"final_latent"})
    def __init__(self, cfg):
        super().__init__(cfg)
        self.separate_sampler = self.settings.switch_ema_ref is not None  # the EMA reference, after the switch
        self.load_state(None)

    @property
    def needs_reference(self) -> bool:
        """The base model: the DGPO loss's reference (unless use_ema_ref) and the KL's."""
        return self.settings.kl_weight > 0 or not self.settings.use_ema_ref

    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        c = self.settings
        super().check_sampling(sampling, step)
        check_whole_groups(sampling, "dgpo", "weighs each group by its members' DPO sum")
        if c.trunc_steps + 1 < c.train_levels or c.trunc_steps >= sampling.steps:
            raise ValueError(f"algorithm.train_levels={c.train_levels} distinct grid steps from 0 … "
                             f"algorithm.trunc_steps={c.trunc_steps} of a {sampling.steps}-step grid: need "
                             f"train_levels ≤ trunc_steps + 1 ≤ sampling.steps")
        if self.cfg.optimizer_steps_per_iteration != 1:
            raise ValueError(f"algorithm 'dgpo' moves its EMA reference after each optimizer step with that step's "
                             f"weights, which an update of several steps does not keep: set "
                             f"algorithm.optimizer_steps_per_iteration=1 (it is {self.cfg.optimizer_steps_per_iteration}; "
                             f"DGPO's gradient accumulation spans the epoch)")

    @property
    def guides_reference(self) -> bool:
        """kl_guidance > 1: the reference is guided with sampling.negative_prompt, which the replay
        encodes even when the rollout was CFG-free (DGPO's dgpo_wocfg: rollouts at 1, kl_cfg 4.5)."""
        return self.settings.kl_guidance > 1

    def check_family(self, family, model=None) -> None:
        if self.settings.kl_guidance > 1 and getattr(family, "guidance", "cfg") != "cfg":
            raise ValueError(f"algorithm.kl_guidance={self.settings.kl_guidance} guides the reference with a negative "
                             f"prompt, and the {family.name} family is guidance-distilled (its scale is a model input, "
                             f"no negative prompt is encoded): set algorithm.kl_guidance=1")

    def terms(self, batch, trained_steps: frozenset[int] | None = None) -> int:
        return self.settings.train_levels

    def losses(self, batch, policy):
        c, fam, gen = self.settings, policy.model, policy.generator
        x0 = policy.tensor(batch["final_latent"]).float()
        adv = torch.clamp(policy.tensor(batch["advantage"]).float(), -c.adv_clip_max, c.adv_clip_max)
        groups, size = whole_groups(np.asarray(batch["group_id"]), x0.device)
        levels = torch.randperm(c.trunc_steps + 1, generator=gen, device=gen.device)[:c.train_levels].tolist()
        old = policy.frozen.get("ema_ref")  # the EMA reference (the first update: its own starting weights)
        guided = c.kl_guidance > 1
        if guided and policy.neg is None:
            raise ValueError("algorithm.kl_guidance > 1 guides the reference with the negative prompt, and this "
                             "replay has no negative encoding (a guidance-distilled family?): set kl_guidance=1")

        plain = conditional_scale(fam, policy.recipe)  # training's unguided forward

        def velocity(model, x, timestep, guided=False):
            g, neg = (c.kl_guidance, policy.neg) if guided else (plain, None)
            return model.velocity(x.to(fam.dtype), timestep, policy.cond, g, neg).float()

        for k in levels:
            t, timestep = policy.sigmas[k].float(), policy.timesteps[k].reshape(1).expand(len(x0))
            shape = (int(groups.max()) + 1, *x0.shape[1:]) if c.shared_noise else x0.shape
            noise = torch.randn(shape, generator=gen, device=gen.device, dtype=torch.float32).to(x0.device)
            noise = noise[groups] if c.shared_noise else noise
            x_t, target = (1 - t) * x0 + t * noise, noise - x0
            dims = tuple(range(1, x0.ndim))
            v = velocity(fam, x_t, timestep)
            with torch.no_grad():
                v_ref = velocity(policy.reference, x_t, timestep, guided)
                v_old = velocity(old, x_t, timestep) if (c.clip_dsm or c.clip_kl or c.use_ema_ref) else None
            dsm = ((target - v) ** 2).mean(dim=dims)
            clip = torch.zeros_like(adv, dtype=torch.bool)
            if v_old is not None:
                old_dsm = ((target - v_old) ** 2).mean(dim=dims)
                clipped, clip = clipped_dsm(dsm, old_dsm, adv, c.clip_range)
                if c.clip_dsm:
                    dsm = clipped
            base = v_old if c.use_ema_ref else v_ref
            w = group_weights(adv, dsm, ((target - base) ** 2).mean(dim=dims), groups, c.beta_dpo, size)
            loss = (w.detach() * adv * dsm).mean()
            metrics = {"policy_loss": loss.detach(), "dgpo/group_weight": w.mean(), "dgpo/dsm": dsm.mean().detach(),
                       "clipfrac": clip.double().mean(), "dgpo/t": t}
            if c.kl_weight > 0:
                kl = ((v - v_ref) ** 2).mean(dim=dims)
                if c.clip_kl:
                    kl = torch.where(clip, kl.detach(), kl)
                loss = loss + c.kl_weight * kl.mean()
                metrics["kl"] = kl.mean().detach()
            yield loss, metrics

    # --- the EMA reference: the algorithm's state ----------------------------------------------
    def _keeps_ema(self) -> bool:
        c = self.settings
        return c.clip_dsm or c.clip_kl or c.use_ema_ref or c.switch_ema_ref is not None

    def frozen_slots(self) -> tuple[str, ...]:
        c = self.settings
        return ("ema_ref",) if c.clip_dsm or c.clip_kl or c.use_ema_ref else ()

    def frozen_weights(self, name: str, start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._ema is None:  # θ_ema starts at the weights of the first update
            self._ema = {k: v.detach().clone() for k, v in start.items()}
        return self._ema

    def sampling_weights(self) -> dict[str, torch.Tensor] | None:
        """The EMA reference once the run has taken more than switch_ema_ref optimizer steps;
        None before (the rollouts sample with the published weights)."""
        s = self.settings.switch_ema_ref
        return self._ema if s is not None and self._step > s else None

    def set_sampling_weights(self, weights: dict[str, torch.Tensor]) -> None:
        if self._ema is None:
            self._ema = weights

    def after_optimizer_step(self, metrics: dict[str, float]) -> dict[str, float]:
        self._step += 1
        return {}

    def end_of_update(self, weights: dict[str, torch.Tensor], optimizer_steps: int) -> dict[str, float]:
        """θ_ema ← d·θ_ema + (1 − d)·θ after the update's one optimizer step, d = min(cap,
        0.001·(optimizer steps before it)) — as DGPO moves it before counting the step."""
        if not self._keeps_ema():
            return {}
        d = min(self.settings.ema_ref_decay, 0.001 * (self._step - 1))
        self._ema = blend(self._ema, weights, d)
        return {"dgpo/ema_decay": d, "dgpo/samples_with_ema": float(self.sampling_weights() is not None)}

    def state(self) -> dict:
        return {"ema": on_host(self._ema),
                "step": self._step}

    def load_state(self, state: dict | None) -> None:
        if state is None:
            self._ema, self._step = None, 0
        else:
            self._ema, self._step = state["ema"], int(state["step"])


def whole_groups(group_ids: np.ndarray, device) -> tuple[torch.Tensor, int]:
    """Each row's group as 0..n−1 in order of appearance, and the group size; a micro-batch
    holding part of a group is refused (its group's weight would miss members)."""
    ids, inverse, counts = np.unique(group_ids, return_inverse=True, return_counts=True)
    if len(set(counts.tolist())) != 1:
        raise ValueError(f"a micro-batch holds groups of sizes {sorted(set(counts.tolist()))}: every group must "
                         f"be whole (sampling.micro_batch a multiple of sampling.group_size)")
    return torch.from_numpy(inverse.astype(np.int64)).to(device), int(counts[0])


def check_whole_groups(sampling: SamplingConfig, name: str, why: str) -> None:
    """Refuse micro-batches that would split a group (an algorithm whose loss reads whole groups)."""
    if sampling.micro_batch % sampling.group_size:
        raise ValueError(f"algorithm {name!r} {why}, so a micro-batch must hold whole groups: set "
                         f"sampling.micro_batch to a multiple of sampling.group_size={sampling.group_size} "
                         f"(it is {sampling.micro_batch})")
