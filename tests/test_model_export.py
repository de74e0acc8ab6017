"""`pixrl export-model`: a trained version written in its base model's own format and loaded back
by that library alone — diffusers' `load_lora_weights` for a LoRA policy (a two-expert Wan2.2's
low-noise expert into transformer_2), `<Pipeline>.from_pretrained` for a full fine-tune or a
merged LoRA, transformers' `load_adapter` / `from_pretrained` for Janus-Pro — computes what the
pixrl policy computes (same velocity / logits; bit for bit unless merged), the untouched
components are the base's, and bad requests fail before anything is written."""

import json
from pathlib import Path

import diffusers
import pytest
import torch
from typer.testing import CliRunner

from family_checks import PassingGuardrail
from pixrl.artifacts.checkpoints import save_checkpoint
from pixrl.cli import app
from pixrl.config.loader import load_config
from pixrl.engines.policy import TrainablePolicy
from pixrl.models.base import uses_negative_prompt
from pixrl.models.registry import get_family
from pixrl.models.wan import WanFamily
from pixrl.stages.inference import _from_pixrl_checkpoint

PROMPTS = ["a red circle", "two blue squares in the sky"]
LORA = ["algorithm.lora.enabled=true", "algorithm.lora.rank=4", "algorithm.lora.alpha=8"]
FULL = ["algorithm.lora.enabled=false"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    def get(family: str):
        out = tmp_path_factory.mktemp("ckpt") / f"tiny-{family}"
        if family == "wan_a14b":
            return {**WanFamily.write_tiny(out, seed=3, two_experts=True), "model.expert": "low"}
        return get_family(family).write_tiny(out, seed=0)
    cache = {}
    return lambda family: cache.setdefault(family, get(family))


def _trained(overrides: dict, tmp_path, mode: list[str]):
    """A pixrl checkpoint whose trainable tensors moved off the base (LoRA's B is no longer zero)."""
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()] + [f"run.workdir={tmp_path}", *mode])
    pol = TrainablePolicy(cfg)
    g = torch.Generator().manual_seed(1)
    weights = {k: v.detach() + 0.05 * torch.randn(v.shape, generator=g).to(v.dtype)
               for k, v in pol.trainable_parameters().items()}
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, weights, {}, {"iteration": 0}, cfg.model_dump(mode="json"))
    return ckpt


def _export(ckpt, out, *flags) -> dict:
    res = CliRunner().invoke(app, ["export-model", "--checkpoint", str(ckpt), "--out", str(out), *flags])
    assert res.exit_code == 0, res.output + repr(res.exception)
    manifest = json.loads((out / "pixrl_export.json").read_text())
    assert json.loads(res.stdout.strip().splitlines()[-1])["format"] == manifest["format"]
    return manifest


def _pipeline(cls, path, family):
    """`cls.from_pretrained(path)`, components saved as [null, null] (SD3 without T5) passed as None
    and those this machine cannot build from the declared class (FLUX.2's PixtralProcessor needs
    torchvision) loaded as the family loads them; a component the family never reads (Cosmos's
    guardrail) given as a stand-in."""
    index = json.loads((Path(path) / "model_index.json").read_text())
    unread = {k: PassingGuardrail() for k in getattr(type(family), "unread_components", ())}
    absent = {k: None for k, v in index.items() if isinstance(v, list) and v[0] is None and k not in unread}
    swapped = type(family).swap_components(Path(path))
    pipe = cls.from_pretrained(str(path), **absent, **unread, **{k: None for k in swapped})
    for name, load in swapped.items():
        setattr(pipe, name, load())
    return pipe


def _velocities(fam, module):
    """The family's guided velocity at one grid step with its own trained module and with `module`."""
    scale = 4.0
    cond = fam.encode_prompts(PROMPTS)
    neg = fam.encode_negative("").expand(2) if uses_negative_prompt(fam, scale) else None
    _, timesteps = fam.schedule(4)
    x = torch.randn((2, *fam.latent_shape()), generator=torch.Generator().manual_seed(0))
    t = timesteps[-1].repeat(2)  # the last step: a two-expert checkpoint's low-noise side
    with torch.no_grad():
        own = fam.velocity(x, t, cond, scale, neg)
        trained, fam.transformer = fam.transformer, module
        try:
            other = fam.velocity(x, t, cond, scale, neg)
        finally:
            fam.transformer = trained
    return own, other


@pytest.mark.parametrize("family", ["sd3", "sd15", "sdxl", "flux1", "flux2", "qwen_image", "sana", "wan", "wan_a14b",
                                    "z_image", "hunyuan_video15", "flux2_klein", "lumina2",
                                    "hunyuan_video", "ltx_video", "mochi", "cogvideox", "cosmos2", "cosmos25", "glm_image", "hunyuan_image", "ltx2"])
def test_a_lora_version_loads_into_the_diffusers_pipeline(family, tiny_dirs, tmp_path):
    overrides = tiny_dirs(family)
    ckpt = _trained(overrides, tmp_path, LORA)
    manifest = _export(ckpt, tmp_path / "lora")
    component = {"wan_a14b": "transformer_2", "sd15": "unet", "sdxl": "unet"}.get(family, "transformer")
    assert manifest["format"] == "diffusers-lora" and manifest["component"] == component
    assert manifest["lora"]["r"] == 4 and manifest["lora"]["lora_alpha"] == 8
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["pixrl_export.json", "pytorch_lora_weights.safetensors"]
    res = CliRunner().invoke(app, ["generate", "--checkpoint", str(tmp_path / "lora"), "--prompt", "x",
                                   "--out", str(tmp_path / "none")])
    assert res.exit_code == 2 and "holds an exported diffusers-lora adapter" in res.output and "--merge" in res.output
    policy, _ = _from_pixrl_checkpoint(ckpt)
    pipe = _pipeline(getattr(diffusers, type(policy.family.pipe).__name__), overrides["model.path"], policy.family)
    if hasattr(pipe, "load_lora_weights"):
        pipe.load_lora_weights(str(tmp_path / "lora"), **({"load_into_transformer_2": True}
                                                         if component == "transformer_2" else {}))
    else:  # a pipeline without LoRA loaders: the model loads its adapter file itself, as the manifest says
        assert f"pipe.{component}.load_lora_adapter(OUT, weight_name=" in manifest["load"]
        getattr(pipe, component).load_lora_adapter(str(tmp_path / "lora"), weight_name="pytorch_lora_weights.safetensors",
                                                    prefix=None)
    own, exported = _velocities(policy.family, getattr(pipe, component))
    base, _ = _velocities(TrainablePolicy(load_config(None, [f"{k}={v}" for k, v in overrides.items()])).family,
                          getattr(pipe, component))
    assert not torch.allclose(own, base, atol=1e-4), "the trained adapter changed nothing"
    assert torch.equal(own, exported)


@pytest.mark.parametrize("family,mode", [("sd3", "full"), ("sd15", "merged"), ("flux1", "merged"), ("wan_a14b", "full"),
                                         ("wan_a14b", "merged")])
def test_a_full_or_merged_version_is_a_whole_diffusers_pipeline(family, mode, tiny_dirs, tmp_path):
    overrides = tiny_dirs(family)
    ckpt = _trained(overrides, tmp_path, FULL if mode == "full" else LORA)
    manifest = _export(ckpt, tmp_path / "model", *(["--merge"] if mode == "merged" else []), "--link")
    assert manifest["format"] == "diffusers-pipeline"
    assert (manifest["merged_lora_layers"] > 0) == (mode == "merged")
    policy, _ = _from_pixrl_checkpoint(ckpt)
    cls = getattr(diffusers, type(policy.family.pipe).__name__)
    pipe, base = _pipeline(cls, tmp_path / "model", policy.family), _pipeline(cls, overrides["model.path"], policy.family)
    component = manifest["component"]
    own, exported = _velocities(policy.family, getattr(pipe, component))
    if mode == "full":
        assert torch.equal(own, exported)
    else:  # W + s·B·A folded once: the order of the sums differs
        torch.testing.assert_close(exported, own, rtol=1e-5, atol=1e-5)
    assert not any("lora" in k for k in getattr(pipe, component).state_dict())
    for name, module in base.components.items():  # every other component is the base's
        if isinstance(module, torch.nn.Module) and name != component:
            got = getattr(pipe, name).state_dict()
            assert all(torch.equal(got[k], v) for k, v in module.state_dict().items()), name


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_janus_exports_a_peft_adapter_or_a_transformers_checkpoint(mode, tiny_dirs, tmp_path):
    from transformers import JanusForConditionalGeneration

    overrides = tiny_dirs("janus_pro")
    ckpt = _trained(overrides, tmp_path, ["algorithm=token_grpo", *(LORA if mode == "lora" else FULL)])
    manifest = _export(ckpt, tmp_path / "janus")
    policy, _ = _from_pixrl_checkpoint(ckpt)
    model = JanusForConditionalGeneration.from_pretrained(
        str(tmp_path / "janus") if mode == "full" else overrides["model.path"])
    if mode == "lora":
        assert manifest["format"] == "peft-adapter"
        model.load_adapter(str(tmp_path / "janus"))
    else:
        assert manifest["format"] == "transformers-checkpoint"
    fam = policy.family
    cond = fam.encode_prompts(PROMPTS)
    tokens = torch.randint(0, 16, (2, fam.image_token_count()), generator=torch.Generator().manual_seed(0))
    base = JanusForConditionalGeneration.from_pretrained(overrides["model.path"]).eval()
    with torch.no_grad():
        own = fam.sequence_logits(cond, tokens, True)
        trained = fam.transformer
        try:
            fam.transformer = model.eval()
            exported = fam.sequence_logits(cond, tokens, True)
            fam.transformer = base
            untrained = fam.sequence_logits(cond, tokens, True)
        finally:
            fam.transformer = trained
    assert not torch.allclose(own, untrained, atol=1e-4), "the trained weights changed nothing"
    assert torch.equal(own, exported)


def test_bad_requests_fail_before_anything_is_written(tiny_dirs, tmp_path):
    overrides = tiny_dirs("sd3")
    ckpt = _trained(overrides, tmp_path, LORA)
    (tmp_path / "taken").mkdir()
    cases = [(["--checkpoint", str(ckpt), "--out", str(tmp_path / "taken")], "already exists; refusing to overwrite"),
             (["--checkpoint", overrides["model.path"], "--out", str(tmp_path / "a")], "is not a pixrl checkpoint"),
             (["--out", str(tmp_path / "b")], "pass one of --checkpoint DIR"),
             (["--checkpoint", str(ckpt), "--best", "--out", str(tmp_path / "c")], "--best picks a run's champion"),
             (["--run", "nope", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "d")], "no run named 'nope'")]
    for args, message in cases:
        res = CliRunner().invoke(app, ["export-model", *args])
        assert res.exit_code == 2 and message in res.output, (args, res.output)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "work") == ["ckpt", "taken"]
    assert not any((tmp_path / "taken").iterdir())


@pytest.mark.parametrize("family", ["flux1", "sd15", "wan"])
def test_pixrl_generates_from_an_exported_directory_of_any_family(family, tiny_dirs, tmp_path):
    """The family is read from the directory's own layout (model_index.json's pipeline class)."""
    overrides = tiny_dirs(family)
    ckpt = _trained(overrides, tmp_path, FULL)
    _export(ckpt, tmp_path / "model")
    res = CliRunner().invoke(app, ["generate", "--checkpoint", str(tmp_path / "model"), "--prompt", "a red circle",
                                   "--out", str(tmp_path / "samples"), "--steps", "2"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    listed = [".jsonl"] if family != "wan" else []  # images are listed as a prompt set of source images; clips not
    assert sorted(p.suffix for p in (tmp_path / "samples").iterdir()) == sorted([".json", ".png", *listed])
    if family == "flux1":  # guidance-distilled: it has no negative-prompt batch to take one
        res = CliRunner().invoke(app, ["generate", "--checkpoint", str(tmp_path / "model"), "--prompt", "a red circle",
                                       "--out", str(tmp_path / "neg"), "--negative-prompt", "blurry"])
        assert res.exit_code == 2 and "batches no negative prompt; drop --negative-prompt" in res.output, res.output
    res = CliRunner().invoke(app, ["generate", "--checkpoint", str(tmp_path), "--prompt", "x",
                                   "--out", str(tmp_path / "none")])
    assert res.exit_code == 2 and "nor a model directory of a registered family" in res.output


def test_pixrl_generates_from_a_base_directory_of_another_family(tiny_dirs, tmp_path):
    """No export manifest: the family from model_index.json, its full prompt length (the default
    recipe's model reads no T5)."""
    overrides = tiny_dirs("flux1")
    res = CliRunner().invoke(app, ["generate", "--checkpoint", overrides["model.path"], "--prompt", "a red circle",
                                   "--out", str(tmp_path / "samples"), "--steps", "2"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert json.loads((tmp_path / "samples" / "0000_00.json").read_text())["prompt"] == "a red circle"
