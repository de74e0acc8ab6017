"""Checks every family's tests share: per-sample generators, the pipeline and family moved onto
a flow-matching Euler scheduler (for families whose shipped solver is multistep), and the
on-policy replay check (stored log-probs reproduced exactly, gradients reaching the transformer)."""

from contextlib import contextmanager

import pytest
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
        memory = None if traj.memory is None else traj.memory[:, j]  # a stateful guider's stored m_{k−1}
        out = replay_step(family, traj.latents[:, j], traj.next_latents[:, j], k, traj.sigmas, traj.timesteps,
                          cond, neg, recipe, memory)
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


def row_negatives(family, prompts, sources, text):
    """CFG's negative conditioning of edit rows as the rollout builds it: the negative prompt read
    with each row's source (`negative_reads_images`) through the prompt cache."""
    from pixrl.engines.prompt_cache import PromptCache
    from pixrl.models.source_images import condition_keys

    keys = condition_keys(prompts, sources)
    return PromptCache(family).negative_rows(text, keys, sources).of(keys)


def edit_pipeline_latents(family, cond, neg, images, cfg, seeds, steps=6):
    """A Qwen-Image-Edit pipeline's packed final latents, one source image a call, given our
    encodings (its own encoding would skip the image marks)."""
    out = []
    for i, (im, s) in enumerate(zip(images, seeds)):
        kw = {"prompt_embeds": cond.prompt_embeds[i:i + 1], "prompt_embeds_mask": None if cond.mask is None
              else cond.mask[i:i + 1]}
        if neg is not None:
            kw.update(negative_prompt_embeds=neg.prompt_embeds[i:i + 1],
                      negative_prompt_embeds_mask=None if neg.mask is None else neg.mask[i:i + 1])
        out.append(family.pipe(image=im, height=family.height, width=family.width, num_inference_steps=steps,
                               true_cfg_scale=cfg,
                               generator=gens([s]), output_type="latent", **kw).images)
    return torch.cat(out)


class PassingGuardrail:
    """What the Cosmos pipelines ask of Cosmos Guardrail (the cosmos_guardrail package, not
    installed here) when called or constructed, passing everything: the guardrail is not what the
    tests compare."""

    def to(self, *args):
        return self

    def check_text_safety(self, prompt):
        return True

    def check_video_safety(self, video):
        return video


def assert_rows_keep_their_frames_and_replay(prompts_jsonl, table, run: str, workdir) -> None:
    """An image-conditioned run's rows each keep the source image of their prompt (from the
    prompt set `prompts_jsonl`), and `pixrl replay` of its iteration 1 is equal."""
    import json

    from typer.testing import CliRunner

    from pixrl.cli import app

    folder = prompts_jsonl.parent
    files = {json.loads(ln)["prompt"]: (folder / json.loads(ln)["image"]).read_bytes()
             for ln in prompts_jsonl.read_text().splitlines()}
    assert all(img == files[p] for p, img in zip(table["prompt"].to_pylist(), table["source_image"].to_pylist()))
    rep = CliRunner().invoke(app, ["replay", run, "--iteration", "1", "--workdir", str(workdir)])
    assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output


def assert_held_frame_is_parameter_free(family, cond, neg, scale: float, sigma: float, per_thousand: bool = True) -> None:
    """An image-to-video family holding its first latent frame clean (models/held_frame.py): that
    frame's velocity is (x − c)/σ whatever the weights, the others move with them. `per_thousand`:
    the family's timestep is σ·1000 (else σ itself: Cosmos)."""
    x = torch.randn((2, *family.latent_shape()), generator=torch.Generator().manual_seed(1))
    t = torch.full((2,), sigma * 1000.0 if per_thousand else sigma)
    v = family.velocity(x, t, cond, scale, neg)
    assert torch.allclose(v[:, :, :1], (x[:, :, :1] - cond.condition) / sigma, atol=1e-5)
    with torch.no_grad():
        for p in family.transformer.parameters():
            p.add_(0.01)
        try:
            moved = family.velocity(x, t, cond, scale, neg)
        finally:
            for p in family.transformer.parameters():
                p.sub_(0.01)
    assert torch.equal(moved[:, :, :1], v[:, :, :1]) and not torch.allclose(moved[:, :, 1:], v[:, :, 1:])


def wide(family_cls, path, height: int, width: int, **kw):
    """The family loaded from `path` at a non-square `height`×`width`: the size every family
    test compares with its pipeline given the same height and width."""
    fam = family_cls.load(path, resolution=(height, width), **kw)
    assert (fam.height, fam.width) == (height, width) and fam.describe()["resolution"] == [height, width]
    return fam


def assert_final_frame_is_the_condition(family, cond, neg, scale: float) -> None:
    """A held-frame family sampled with the SDE on every step, the last included: the stored last
    transition leaves the first frame off the condition by its noise, and the final latents hold
    the condition there exactly (the pipelines' overwrite, `final_latents`)."""
    steps = 4
    traj = sample(family, cond, neg, gens([5, 6]), SamplerRecipe(steps=steps, noise_level=0.7, guidance_scale=scale,
                                                                 train_steps=tuple(range(steps))))
    assert (traj.next_latents[:, -1, :, :1] - cond.condition).abs().max().item() > 1e-3
    assert torch.equal(traj.final[:, :, :1], cond.condition.to(traj.final.dtype))
    assert torch.equal(traj.final[:, :, 1:], traj.next_latents[:, -1, :, 1:])


def assert_needs_its_source_images(family, prompts: list[str], timestep: float) -> None:
    """An image-conditioned family refuses prompts without a source image each, and a velocity
    from prompts encoded without them, naming what it needs."""
    from pixrl.models.source_images import SourceImageError

    with pytest.raises(SourceImageError, match="every prompt needs a source image"):
        family.encode_prompts(prompts, [None] * len(prompts))
    with pytest.raises(SourceImageError, match="encoded without source images"):
        family.velocity(torch.zeros((1, *family.latent_shape())), torch.tensor([timestep]),
                        family.encode_prompts(prompts[:1]))
