"""FLUX.2 as an editing model, on its tiny random checkpoint: a prompt with a source image is
conditioned on it as Flux2Pipeline conditions on one reference `image` (ODE latents equal), the
reference reaches the velocity, replay is exact, text-to-image prompts are unchanged, a prompt set
that mixes the two is refused, and two iterations of edits run through the unchanged flow."""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, gens
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.cli import app
from pixrl.models.flux2 import Flux2Family
from pixrl.models.flux_kontext import write_edit_prompts
from pixrl.models.source_images import SourceImageError, png_bytes

PROMPTS = ["make the sky red", "add a blue square"]


@pytest.fixture(scope="module")
def family(tiny_flux2):
    """At 64 px: the pipeline refuses reference images under 64 px a side."""
    path, overrides = tiny_flux2
    return Flux2Family.load(path, max_sequence_length=overrides["model.max_sequence_length"], resolution=64)


@pytest.fixture(scope="module")
def sources(family):
    rng = np.random.default_rng(3)
    return [png_bytes(rng.integers(0, 256, (family.height, family.width, 3))) for _ in PROMPTS]


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_an_edit_equals_flux2_pipeline_with_one_reference_image(family, sources, guidance):
    recipe = SamplerRecipe(steps=6, noise_level=0.0, guidance_scale=guidance, train_steps=())
    traj = sample(family, family.encode_prompts(PROMPTS, sources), None, gens([5, 6]), recipe)
    for i, (prompt, src, seed) in enumerate(zip(PROMPTS, sources, [5, 6])):  # the pipeline: one reference per call
        ref = family.pipe(prompt=[prompt], image=[Image.open(io.BytesIO(src)).convert("RGB")], num_inference_steps=6,
                          guidance_scale=guidance, generator=gens([seed]), output_type="latent",
                          height=family.height, width=family.width,
                          max_sequence_length=family.max_sequence_length).images
        assert (family.pipe._pack_latents(traj.final[i:i + 1]) - ref).abs().max().item() <= 1e-5
    text = sample(family, family.encode_prompts(PROMPTS), None, gens([5, 6]), recipe)
    assert (text.final - traj.final).abs().max().item() > 1e-4  # the reference reaches the velocity
    assert family.encode_prompts(PROMPTS, [None, None]).image_latents is None  # text-to-image, unchanged


def test_a_non_square_edit_equals_flux2_pipeline(tiny_flux2):
    """A 64×96 target and reference (the pipeline keeps a reference of the target's size)."""
    fam = Flux2Family.load(tiny_flux2[0], max_sequence_length=tiny_flux2[1]["model.max_sequence_length"],
                           resolution=(64, 96))
    rng = np.random.default_rng(4)
    src = png_bytes(rng.integers(0, 256, (64, 96, 3)))
    traj = sample(fam, fam.encode_prompts(PROMPTS[:1], [src]), None, gens([5]),
                  SamplerRecipe(steps=6, noise_level=0.0, guidance_scale=4.0, train_steps=()))
    ref = fam.pipe(prompt=PROMPTS[:1], image=[Image.open(io.BytesIO(src)).convert("RGB")], num_inference_steps=6,
                   guidance_scale=4.0, generator=gens([5]), output_type="latent", height=64, width=96,
                   max_sequence_length=fam.max_sequence_length).images
    assert traj.final.shape == (1, 16, 16, 24)
    assert (fam.pipe._pack_latents(traj.final) - ref).abs().max().item() <= 1e-5


def test_edits_replay_exactly_and_a_mixed_batch_is_refused(family, sources):
    recipe = SamplerRecipe(steps=4, noise_level=0.9, sde_type="sde", guidance_scale=4.0, train_steps=(0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS, sources), None, recipe)
    with pytest.raises(SourceImageError, match="mix edits"):
        family.encode_prompts(PROMPTS, [sources[0], None])


def test_two_iterations_of_edits_through_the_flow(tiny_flux2, tmp_path, prefect_harness):
    edits = write_edit_prompts(tmp_path / "edits", seed=2)
    out, t = two_iterations(tiny_flux2, tmp_path, "flux2_edit", "lora", "sampling.guidance_scale=4.0", "dataset=edits",
                            f"dataset.path={edits}")
    assert t["source_image"].null_count == 0
    mixed = edits.parent / "mixed.jsonl"  # beside the images its lines name
    mixed.write_text(edits.read_text() + json.dumps({"prompt": "a red circle"}) + "\n")
    res = CliRunner().invoke(app, ["train", "-n", "1", "--workdir", str(tmp_path / "wd2"), "model.family=flux2",
                                   f"model.path={tiny_flux2[0]}", "model.max_sequence_length=96", "dataset=edits",
                                   f"dataset.path={mixed}"])
    assert res.exit_code == 2 and "all edits or all text-to-image" in " ".join(res.output.split()), res.output
