"""DiffusionOPD — online policy distillation of a diffusion student from a frozen teacher on the
student's own trajectories (DiffusionOPD, Li et al. 2026, arXiv 2605.15055; VeRL-Omni's
`distill_kl` loss and teacher replay, docs/algo/diffusion_opd.md).

The student samples with the Flow-GRPO SDE (its own rollouts, the stored SDE transitions); the
teacher — a registered policy version of the same model (`algorithm.teacher=models:/NAME/VERSION`,
e.g. a flow_grpo run's published policy) — replays each stored transition from the same state,
with the same conditioning, guidance, grid and noise level, and the student minimises the KL
between the two Gaussian transition kernels, per stored transition j:

    KL_j = mean_CHW (μ_θ(x_j) − μ_T(x_j))² / (2·s_j²)

s_j the step's SDE std (flow_grpo's std_dev_t: the same quantity as Flow-GRPO's KL to its
reference, `flow_sde.kl_to_reference`). Every stored transition of every sample is a term: the
signal is dense and needs no reward, which is scored and logged but enters no loss
(`policy_gradient: false`, VeRL-Omni's `loss_mode=distill_kl`). With `policy_gradient: true` the
term is added to Flow-GRPO's PPO-clip loss with weight `distill_coef` (VeRL-Omni's
`use_distill_loss`). Flow-GRPO's KL to the reference (`beta`) stays a term of its own: the
reference (the base model) and the teacher are different policies.

The teacher never trains and never enters the student's checkpoints. A registered version: the
stage layer resolves it to its checkpoint, the engine loads its trained tensors into a frozen copy
beside the student (under LoRA the copy costs the teacher's adapter), so teacher and student train
the same tensors — the same LoRA settings, or both a full fine-tune. A diffusers directory of the
same architecture (a merged fine-tune, VeRL-Omni's teacher_path): its trained component is loaded
whole as a module of its own (its own memory). A teacher of another architecture (a larger
sibling) is not supported.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from pydantic import Field

from .base import register_algorithm
from .flow_grpo import FlowGRPO, FlowGRPOSettings, Transition
from .flow_sde import kl_to_reference

TEACHER = "teacher"
MODEL_URI = re.compile(r"^models:/[^/]+/[0-9]+$")


class DiffusionOPDSettings(FlowGRPOSettings):
    teacher: str | None = Field(None, description="the frozen teacher: models:/NAME/VERSION (a registered policy of "
                                "this model trained with the same adapter settings) or a diffusers directory of the "
                                "same architecture (a merged fine-tune)")
    distill_coef: float = Field(1.0, gt=0, description="weight of the transition KL to the teacher")
    policy_gradient: bool = Field(False, description="add Flow-GRPO's PPO-clip loss on the rewards' advantages "
                                  "(VeRL-Omni's use_distill_loss); false: distillation alone, rewards only logged")


@register_algorithm("diffusion_opd")
class DiffusionOPD(FlowGRPO):
    Settings = DiffusionOPDSettings

    def check_family(self, family, model=None) -> None:
        t = self.settings.teacher
        if t is None:
            raise ValueError("algorithm 'diffusion_opd' distills a teacher: set algorithm.teacher=models:/NAME/VERSION "
                             "— a registered policy of this model trained with the same algorithm.lora settings "
                             "(e.g. a flow_grpo run's published `<experiment>-policy` version) — or a diffusers "
                             "directory of the same model")
        if t.startswith("models:") and not MODEL_URI.match(t):
            raise ValueError(f"algorithm.teacher={t!r}: expected models:/NAME/VERSION, e.g. models:/pixrl-policy/12")

    def check_sampling(self, sampling, step: str) -> None:
        if step != "denoise":
            raise ValueError("algorithm 'diffusion_opd' distills the SDE transitions of flow-matching (denoise) "
                             "families")

    def trains_on(self, advantages: np.ndarray, group_ids: np.ndarray | None = None) -> np.ndarray:
        """Distillation trains every sample (its signal is the teacher's, not the advantage)."""
        if self.settings.policy_gradient:
            return super().trains_on(advantages, group_ids)
        return np.ones(len(advantages), dtype=bool)

    # --- the teacher: a stored policy in a frozen slot ----------------------------------------
    def stored_policies(self) -> dict[str, str]:
        return {TEACHER: self.settings.teacher} if self.settings.teacher else {}

    def frozen_slots(self) -> tuple[str, ...]:
        return (TEACHER,)  # filled by the engine from the stored policy (frozen_weights: None)

    # --- the loss -------------------------------------------------------------------------------
    def step_loss(self, tr: Transition, batch, adv: torch.Tensor, policy):
        """distill_coef · KL(student ‖ teacher) of one stored transition, beside Flow-GRPO's loss
        (policy_gradient) or its KL to the reference alone (beta > 0)."""
        c = self.settings
        with torch.no_grad():
            teacher = policy.step(tr.x, tr.x_next, tr.k, under=TEACHER)
        kl = kl_to_reference(tr.new.mean, teacher.mean, tr.new.std_dev_t).mean()
        if c.policy_gradient:
            loss, metrics = super().step_loss(tr, batch, adv, policy)
        else:
            loss, metrics = torch.zeros((), device=kl.device), {}
            if c.beta > 0:
                ref_kl = self.reference_kl(tr, policy, tr.new.std_dev_t)
                loss, metrics["kl"] = c.beta * ref_kl, ref_kl.detach()
        metrics["distill_kl"] = kl.detach()
        return loss + c.distill_coef * kl, metrics
