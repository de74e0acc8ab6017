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

Multi-teacher (MOPD, VeRL-Omni's multi-teacher routing): `algorithm.teachers` maps a task to its
teacher (either source), and each prompt's metadata field `route_by` (default `category`: a prompt
file's category or GenEval tag) names its task; each stored transition is distilled toward its
prompt's teacher (the key `default`, if given, takes the tasks no other key names). Every prompt of the
dataset must route to a teacher — checked before a run.
"""

from __future__ import annotations

import json
import re

import numpy as np
import torch
from pydantic import Field

from .base import register_algorithm
from .flow_grpo import FlowGRPO, FlowGRPOSettings, Transition
from .flow_sde import kl_to_reference
from .replay import policy_rows

TEACHER = "teacher"
FALLBACK = "default"  # the teachers key that takes the tasks no other key names
MODEL_URI = re.compile(r"^models:/[^/]+/[0-9]+$")


class DiffusionOPDSettings(FlowGRPOSettings):
    teacher: str | None = Field(None, description="the frozen teacher: models:/NAME/VERSION (a registered policy of "
                                "this model trained with the same adapter settings) or a diffusers directory of the "
                                "same architecture (a merged fine-tune)")
    distill_coef: float = Field(1.0, gt=0, description="weight of the transition KL to the teacher")
    teachers: dict[str, str] | None = Field(None, description="multi-teacher distillation: a task (the prompt "
                                            "metadata field route_by) → its teacher, as algorithm.teacher takes "
                                            "one; the key 'default' takes the tasks no other key names")
    route_by: str = Field("category", description="the prompt metadata field that names a prompt's task")
    policy_gradient: bool = Field(False, description="add Flow-GRPO's PPO-clip loss on the rewards' advantages "
                                  "(VeRL-Omni's use_distill_loss); false: distillation alone, rewards only logged")


@register_algorithm("diffusion_opd")
class DiffusionOPD(FlowGRPO):
    Settings = DiffusionOPDSettings

    def __init__(self, cfg):
        super().__init__(cfg)
        if self.settings.teachers:  # each row's task is read from its prompt's metadata
            self.needs = FlowGRPO.needs | {"prompt_meta"}

    def check_family(self, family, model=None) -> None:
        c = self.settings
        if c.teacher and c.teachers:
            raise ValueError("algorithm.teacher and algorithm.teachers both set: one teacher, or a teacher per task "
                             "(unset algorithm.teacher, or put it in algorithm.teachers under the key 'default')")
        for t in (c.teachers or {}).values() if c.teachers else [c.teacher]:
            _check_source(t)

    def check_prompt_meta(self, metas: list[dict]) -> None:
        """Every prompt routes to a teacher (multi-teacher): its task has a key, or 'default' is given."""
        teachers, field = self.settings.teachers, self.settings.route_by
        if not teachers or FALLBACK in teachers:
            return
        lacking = sorted({str(m.get(field, "")) for m in metas} - set(teachers))
        if lacking:
            more = " …" if len(lacking) > 5 else ""
            raise ValueError(f"algorithm.teachers has no teacher for the prompts whose {field!r} is "
                             f"{', '.join(repr(t) for t in lacking[:5])}{more} (its keys: {', '.join(sorted(teachers))}"
                             f"); add a teacher for them or one under the key 'default', or set dataset.categories "
                             f"to the tasks it has (algorithm.route_by names the field)")

    def check_sampling(self, sampling, step: str) -> None:
        if step != "denoise":
            raise ValueError("algorithm 'diffusion_opd' distills the SDE transitions of flow-matching (denoise) "
                             "families")

    def trains_on(self, advantages: np.ndarray, group_ids: np.ndarray | None = None) -> np.ndarray:
        """Distillation trains every sample (its signal is the teacher's, not the advantage)."""
        if self.settings.policy_gradient:
            return super().trains_on(advantages, group_ids)
        return np.ones(len(advantages), dtype=bool)

    # --- the teachers: stored policies in frozen slots -----------------------------------------
    def stored_policies(self) -> dict[str, str]:
        c = self.settings
        if c.teachers:
            return {slot_of(task): t for task, t in c.teachers.items()}
        return {TEACHER: c.teacher} if c.teacher else {}

    def frozen_slots(self) -> tuple[str, ...]:
        """Filled by the engine from the stored policies (frozen_weights: None)."""
        return tuple(self.stored_policies()) or (TEACHER,)

    # --- the loss -------------------------------------------------------------------------------
    def step_loss(self, tr: Transition, batch, adv: torch.Tensor, policy):
        """distill_coef · KL(student ‖ teacher) of one stored transition, beside Flow-GRPO's loss
        (policy_gradient) or its KL to the reference alone (beta > 0)."""
        c = self.settings
        with torch.no_grad():
            teacher_mean = self.teacher_means(tr, batch, policy)
        kl = kl_to_reference(tr.new.mean, teacher_mean, tr.new.std_dev_t).mean()
        if c.policy_gradient:
            loss, metrics = super().step_loss(tr, batch, adv, policy)
        else:
            loss, metrics = torch.zeros((), device=kl.device), {}
            if c.beta > 0:
                ref_kl = self.reference_kl(tr, policy, tr.new.std_dev_t)
                loss, metrics["kl"] = c.beta * ref_kl, ref_kl.detach()
        metrics["distill_kl"] = kl.detach()
        return loss + c.distill_coef * kl, metrics

    def teacher_means(self, tr: Transition, batch, policy) -> torch.Tensor:
        """μ_T of each row's transition under its teacher: one step of the micro-batch under the
        one teacher, or, routed, one step per teacher of the rows whose task it takes."""
        if not self.settings.teachers:
            return policy.step(tr.x, tr.x_next, tr.k, under=TEACHER).mean
        slots = self.routes(batch["prompt_meta"])
        if len(set(slots)) == 1:
            return policy.step(tr.x, tr.x_next, tr.k, under=slots[0]).mean
        mean = torch.empty_like(tr.new.mean)
        for slot in dict.fromkeys(slots):
            rows = [i for i, s in enumerate(slots) if s == slot]
            mean[rows] = policy_rows(policy, rows).step(tr.x[rows], tr.x_next[rows], tr.k, under=slot).mean.to(mean)
        return mean

    def routes(self, prompt_meta) -> list[str]:
        """The frozen slot of each row's teacher, from its prompt's metadata (JSON)."""
        teachers, field = self.settings.teachers, self.settings.route_by
        out = []
        for meta in prompt_meta:
            task = str(json.loads(meta or "{}").get(field, ""))
            if task not in teachers and FALLBACK not in teachers:
                raise ValueError(f"a stored row's prompt has {field}={task!r}, and algorithm.teachers has no teacher "
                                 f"for it (keys: {', '.join(sorted(teachers))})")
            out.append(slot_of(task if task in teachers else FALLBACK))
        return out


def slot_of(task: str) -> str:
    """The frozen slot of a task's teacher."""
    return f"{TEACHER}:{task}"


def _check_source(t: str | None) -> None:
    """A teacher: models:/NAME/VERSION or a directory (resolved and checked when the run opens)."""
    if t is None:
        raise ValueError("algorithm 'diffusion_opd' distills a teacher: set algorithm.teacher=models:/NAME/VERSION "
                         "— a registered policy of this model trained with the same algorithm.lora settings "
                         "(e.g. a flow_grpo run's published `<experiment>-policy` version) — or a diffusers "
                         "directory of the same model; or algorithm.teachers, one per task")
    if t.startswith("models:") and not MODEL_URI.match(t):
        raise ValueError(f"algorithm.teacher={t!r}: expected models:/NAME/VERSION, e.g. models:/pixrl-policy/12")
