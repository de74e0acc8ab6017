"""Checks every family's tests share: per-sample generators, the pipeline and family moved onto
a flow-matching Euler scheduler (for families whose shipped solver is multistep), and the
on-policy replay check (stored log-probs reproduced exactly, gradients reaching the transformer)."""

from contextlib import contextmanager

import torch

from pixrl.algorithms.sampling import SamplerRecipe, replay_step, sample


def gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


@contextmanager
def euler(family):
    """The pipeline and the family on a FlowMatchEulerDiscreteScheduler with the checkpoint's flow shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    shipped = family.scheduler
    family.scheduler = family.pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=shipped.config.flow_shift)
    try:
        yield
    finally:
        family.scheduler = family.pipe.scheduler = shipped


def assert_replay_is_on_policy(family, cond, neg, recipe: SamplerRecipe, seeds=(0, 1)) -> None:
    """Sample with `recipe`, replay every stored step: the log-probs equal the stored ones bit for
    bit (ratio exactly 1), and the gradient reaches the transformer."""
    traj = sample(family, cond, neg, gens(seeds), recipe)
    assert list(traj.stored_steps) == list(recipe.train_steps)
    for j, k in enumerate(traj.stored_steps):
        out = replay_step(family, traj.latents[:, j], traj.next_latents[:, j], k, traj.sigmas, traj.timesteps,
                          cond, neg, recipe)
        assert torch.equal(out.log_prob.detach(), traj.log_probs[:, j])
        out.log_prob.sum().backward()
    assert any(p.grad is not None for p in family.transformer.parameters())
    family.transformer.zero_grad(set_to_none=True)


class WithImageMarks(torch.nn.Module):
    """A Qwen-VL text encoder given the processor's `mm_token_type_ids`, which the Qwen-Image-Edit
    pipelines' call drops (without them transformers 5 places image tokens sequentially)."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    @property
    def dtype(self):
        return self.encoder.dtype

    def forward(self, **kw):
        marks = (kw["input_ids"] == self.encoder.config.image_token_id).to(torch.int32)
        return self.encoder(**kw, mm_token_type_ids=marks)
