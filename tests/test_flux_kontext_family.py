"""FLUX.1 Kontext (instruction editing) on a tiny random checkpoint written by `pixrl tiny
flux1_kontext`: ODE parity with diffusers' FluxKontextPipeline given the same source images,
the source image reaching the velocity, replayed log-probs equal to the stored ones, editing
prompt sets, condition keys in the prompt cache, the refusals, and two RL iterations through the
unchanged flow with LoRA and full fine-tuning (rows keep their source images)."""

import io
import json

import lance
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from conftest import tiny_overrides, two_iterations
from family_checks import assert_replay_is_on_policy, gens, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.cli import app
from pixrl.datasets.prompts import PromptSetError, load_prompt_set
from pixrl.engines.prompt_cache import PromptCache
from pixrl.models.base import ModelLoadError
from pixrl.models.flux_kontext import FluxKontextFamily
from pixrl.models.registry import family_of_directory, get_family
from pixrl.models.source_images import SourceImageError, condition_keys, png_bytes

PROMPTS = ["make the sky red", "add a blue square"]


@pytest.fixture(scope="module")
def family(tiny_flux_kontext):
    path, overrides = tiny_flux_kontext
    return FluxKontextFamily.load(path, max_sequence_length=64, resolution=overrides["model.resolution"])


@pytest.fixture(scope="module")
def sources(tiny_flux_kontext):
    return [(tiny_flux_kontext[0] / "edits" / f"source_{i}.png").read_bytes() for i in range(2)]


def test_registered_and_found_from_its_layout(tiny_flux_kontext):
    assert get_family("flux1_kontext") is FluxKontextFamily and FluxKontextFamily.takes_images
    assert family_of_directory(tiny_flux_kontext[0]) == "flux1_kontext"
    assert json.loads((tiny_flux_kontext[0] / "model_index.json").read_text())["_class_name"] == "FluxKontextPipeline"


def test_a_flux1_checkpoint_is_refused_naming_the_pipeline(tiny_flux):
    with pytest.raises(ModelLoadError, match="holds a FluxPipeline, not a FluxKontextPipeline"):
        FluxKontextFamily.load(tiny_flux[0], max_sequence_length=64)


@pytest.mark.parametrize("guidance", [1.0, 2.5])
def test_ode_sampling_equals_flux_kontext_pipeline(family, sources, guidance):
    side = family.height
    ref = family.pipe(prompt=PROMPTS, image=[Image.open(io.BytesIO(b)).convert("RGB") for b in sources],
                      height=side, width=side, max_area=side * side, _auto_resize=False, num_inference_steps=6,
                      guidance_scale=guidance, output_type="latent", generator=gens([3, 4]),
                      max_sequence_length=64).images
    recipe = SamplerRecipe(steps=6, noise_level=0.0, guidance_scale=guidance, train_steps=())
    traj = sample(family, family.encode_prompts(PROMPTS, sources), None, gens([3, 4]), recipe)
    packed = family.pipe._pack_latents(traj.final, 2, *family.latent_shape())
    assert packed.shape == ref.shape and (packed - ref).abs().max().item() <= 1e-5
    other = sample(family, family.encode_prompts(PROMPTS, sources[::-1]), None, gens([3, 4]), recipe)
    assert (other.final - traj.final).abs().max().item() > 1e-4  # the source image reaches the velocity


def test_non_square_ode_equals_the_pipeline(tiny_flux_kontext, sources):
    """A 32×48 target; each source read at it (aspect kept, centre-cropped) — what the pipeline
    is given, so that its own resize keeps it."""
    fam = wide(FluxKontextFamily, tiny_flux_kontext[0], 32, 48, max_sequence_length=64)
    images = [fam.pipe.image_processor.resize(Image.open(io.BytesIO(b)).convert("RGB"), 32, 48, resize_mode="crop")
              for b in sources]
    ref = fam.pipe(prompt=PROMPTS, image=images, height=32, width=48, max_area=32 * 48, _auto_resize=False,
                   num_inference_steps=6, guidance_scale=2.5, output_type="latent", generator=gens([3, 4]),
                   max_sequence_length=64).images
    traj = sample(fam, fam.encode_prompts(PROMPTS, sources), None, gens([3, 4]),
                  SamplerRecipe(steps=6, noise_level=0.0, guidance_scale=2.5, train_steps=()))
    packed = fam.pipe._pack_latents(traj.final, 2, *fam.latent_shape())
    assert packed.shape == ref.shape and (packed - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored(family, sources, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.9, sde_type=sde_type, guidance_scale=2.5, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS, sources), None, recipe)


def test_encoding_refuses_a_prompt_without_an_image(family):
    with pytest.raises(SourceImageError, match="every prompt needs a source image"):
        family.encode_prompts(PROMPTS)


def test_the_prompt_cache_keys_each_instruction_with_its_image(family, sources):
    """One instruction on two images: two encodings; keys name both, and the text-only key refuses."""
    cache = PromptCache(family)
    keys = condition_keys(["make the sky red"] * 2, sources)
    assert keys[0] != keys[1] and keys[0].startswith("make the sky red")
    cond, pos = cache.encode(keys, sources)
    assert cond.image_latents.shape[0] == 2 and len(pos) == 2
    assert not torch.equal(cond.image_latents[pos[keys[0]]], cond.image_latents[pos[keys[1]]])
    assert torch.equal(cond.prompt_embeds[0], cond.prompt_embeds[1])
    assert cache.encode(keys)[0] is cond  # a hit needs no images
    with pytest.raises(RuntimeError, match="no source image with digest"):
        PromptCache(family).encode(keys)


def test_editing_prompt_sets(tmp_path):
    img = png_bytes(np.full((8, 8, 3), 200))
    (tmp_path / "a.png").write_bytes(img)
    (tmp_path / "set.jsonl").write_text(json.dumps({"prompt": "make it blue", "image": "a.png", "tag": "color"}) + "\n")
    (item,) = load_prompt_set(tmp_path / "set.jsonl")
    assert item.image == img and item.meta == {"tag": "color", "category": "color"}
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{"prompt": "y", "image": "missing.png"}\n')
    with pytest.raises(PromptSetError, match=r"bad.jsonl:2: source image .*missing.png.* does not exist"):
        load_prompt_set(tmp_path / "bad.jsonl")
    pq.write_table(pa.table({"prompt": ["make it blue"], "image": pa.array([img], pa.binary())}), tmp_path / "s.parquet")
    assert load_prompt_set(tmp_path / "s.parquet")[0].image == img


def test_preflight_matches_family_and_dataset(tiny_flux_kontext, tiny_flux, tmp_path):
    """Before anything is written: an editing family without images, a text family with them, Ray."""
    path, overrides = tiny_flux_kontext
    base = ["train", "-n", "1", "--workdir", str(tmp_path / "wd")]
    res = CliRunner().invoke(app, [*base, "model.family=flux1_kontext", f"model.path={path}", "model.max_sequence_length=64"])
    assert res.exit_code == 2 and "edits images, and" in res.output and "have no source image" in res.output
    res = CliRunner().invoke(app, [*base, "model.family=flux1", f"model.path={tiny_flux[0]}", "model.max_sequence_length=64",
                                   f"dataset.path={overrides['dataset.path']}", "dataset.name=edits",
                                   "dataset.heldout_path=null", "dataset.categories=null"])
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "generates from text alone" in said
    assert "flux1_kontext, flux2, flux2_klein," in said and "wan_ti2v" in said  # every family that takes images
    assert not (tmp_path / "wd").exists()


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_rl_iterations_through_the_unchanged_flow(tiny_flux_kontext, tmp_path, prefect_harness, mode):
    out, t = two_iterations(tiny_flux_kontext, tmp_path, f"kontext_{mode}", mode, "sampling.guidance_scale=2.5")
    folder = tiny_flux_kontext[0] / "edits"
    files = {json.loads(ln)["prompt"]: (folder / json.loads(ln)["image"]).read_bytes()
             for ln in (folder / "edits.jsonl").read_text().splitlines()}
    assert t["source_image"].null_count == 0
    assert all(img == files[p] for p, img in zip(t["prompt"].to_pylist(), t["source_image"].to_pylist()))
    if mode == "lora":  # the replayed update reads the stored images and equals the recorded checkpoint
        rep = CliRunner().invoke(app, ["replay", f"kontext_{mode}", "--iteration", "1", "--workdir", str(tmp_path)])
        assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output
        _offline_dpo_on_the_archived_edits(tiny_flux_kontext, tmp_path, f"kontext_{mode}", files)
        _generate_edits_from_the_run(tmp_path, f"kontext_{mode}", folder)
        _export_the_edit_model(tiny_flux_kontext, tmp_path, f"kontext_{mode}", files)


def _export_the_edit_model(tiny, tmp_path, run, files):
    """`pixrl export-model`: the adapter loads into FluxKontextPipeline with `load_lora_weights` and
    gives the trained velocity; `--merge` makes a whole pipeline directory `pixrl generate --image`
    edits with."""
    from diffusers import FluxKontextPipeline

    from pixrl.stages.inference import _from_pixrl_checkpoint

    (ckpt,) = (tmp_path / "checkpoints" / run).glob("*/it_0001")
    res = CliRunner().invoke(app, ["export-model", "--checkpoint", str(ckpt), "--out", str(tmp_path / "lora")])
    assert res.exit_code == 0, res.output
    pipe = FluxKontextPipeline.from_pretrained(str(tiny[0]))
    pipe.load_lora_weights(str(tmp_path / "lora"))
    policy, _ = _from_pixrl_checkpoint(ckpt)
    fam = policy.family
    prompts, images = list(files), list(files.values())
    cond = fam.encode_prompts(prompts, images)
    x = torch.randn((len(prompts), *fam.latent_shape()), generator=torch.Generator().manual_seed(0))
    t = fam.schedule(4)[1][1].repeat(len(prompts))
    with torch.no_grad():
        own = fam.velocity(x, t, cond, 2.5)
        trained, fam.transformer = fam.transformer, pipe.transformer
        try:
            exported = fam.velocity(x, t, cond, 2.5)
        finally:
            fam.transformer = trained
    assert torch.equal(own, exported)
    res = CliRunner().invoke(app, ["export-model", "--checkpoint", str(ckpt), "--out", str(tmp_path / "merged"),
                                   "--merge", "--link"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["generate", "--checkpoint", str(tmp_path / "merged"), "--prompt", prompts[0],
                                   "--image", str(tiny[0] / "edits" / "source_0.png"), "--out", str(tmp_path / "m"),
                                   "--steps", "2"])
    assert res.exit_code == 0 and (tmp_path / "m" / "0000_00.png").is_file(), res.output


def _generate_edits_from_the_run(tmp_path, run, folder):
    """`pixrl generate --image`: the trained policy edits the given source image; without one, or
    with a count that matches nothing, it stops naming the fix."""
    base = ["generate", "--run", run, "--workdir", str(tmp_path), "--prompt", "make the sky red", "--prompt", "add a star"]
    res = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "gen"), "--image", str(folder / "source_0.png")])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "gen").glob("*.png")) == ["0000_00.png", "0001_00.png"]
    res = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "gen2")])
    assert res.exit_code == 2 and "pass --image PATH" in res.output
    res = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "gen3"), *["--image", str(folder / "source_0.png")] * 3])
    assert res.exit_code == 2 and "3 --image paths for 2 prompts" in res.output

def _offline_dpo_on_the_archived_edits(tiny, tmp_path, source, files):
    """`pixrl dpo` from the editing run: each pair keeps its source image and the update is
    conditioned on it; the tiny edits set has no held-out prompts, which the result says."""
    path, overrides = tiny
    extra = [f"{k}={v}" for k, v in overrides.items() if k != "model.path"]
    res = CliRunner().invoke(app, ["dpo", "--from", source, "-n", "2", "--run", "kdpo", "--workdir", str(tmp_path),
                                   f"model.path={path}", *extra, "dpo.pairs_per_step=2", "model.device=cpu",
                                   "model.dtype=float32"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["heldout_before"] is None and "not evaluated: dataset 'edits' has no held-out prompts" in res.output
    (pairs_dir,) = tmp_path.glob("lance/kdpo/*/pairs.lance")
    pairs = lance.dataset(str(pairs_dir))
    t = pairs.to_table(columns=["prompt", "source_image", "recipe"])
    assert t.num_rows > 0 and all(img == files[p] for p, img in zip(t["prompt"].to_pylist(), t["source_image"].to_pylist()))
    assert {json.loads(r)["guidance_scale"] for r in t["recipe"].to_pylist()} == {2.5}  # what the update trains at


def test_a_non_square_source_is_centre_cropped_not_stretched(family):
    rng = np.random.default_rng(4)
    square = rng.integers(0, 256, (32, 32, 3))
    wide = np.concatenate([rng.integers(0, 256, (32, 16, 3)), square, rng.integers(0, 256, (32, 16, 3))], axis=1)
    a = family.encode_prompts(["x"], [png_bytes(square)]).image_latents
    b = family.encode_prompts(["x"], [png_bytes(wide)]).image_latents
    assert torch.equal(a, b)
