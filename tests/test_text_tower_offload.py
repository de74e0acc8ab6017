"""`model.offload_text_encoders`: a diffusers family's text towers rest in host memory and are on
their device only while a prompt set is encoded — the encodings equal those of towers that never
moved, the towers go back even when encoding fails, and a family without separate towers is
refused before anything runs. (On this CPU-only machine both places are the host; the memory it
frees on a GPU is measured by `benchmarks/gpu_checks.py`'s flux2 smoke.)"""

import dataclasses

import pytest
import torch

from pixrl.config.loader import load_config
from pixrl.engines.policy import TrainablePolicy
from pixrl.models.registry import get_family
from pixrl.stages.preflight import PreflightError, preflight

PIPELINE_FAMILIES = ["sd3", "flux1", "flux2", "qwen_image", "sana", "wan", "z_image", "flux2_klein", "lumina2", "cosmos2", "cosmos25", "glm_image", "hunyuan_image", "ltx2"]
PROMPTS = ["a red circle", "two blue squares in the sky"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    def get(family: str):
        out = tmp_path_factory.mktemp("ckpt") / f"tiny-{family}"
        return out, get_family(family).write_tiny(out, seed=0)
    cache = {}
    return lambda family: cache.setdefault(family, get(family))


def _policy(tiny_dirs, family: str, offload: bool) -> TrainablePolicy:
    path, overrides = tiny_dirs(family)
    return TrainablePolicy(load_config(None, [*(f"{k}={v}" for k, v in overrides.items()),
                                              f"model.offload_text_encoders={str(offload).lower()}"]))


def _tensors(cond) -> dict[str, torch.Tensor]:
    return {f.name: getattr(cond, f.name) for f in dataclasses.fields(cond)
            if isinstance(getattr(cond, f.name), torch.Tensor)}


@pytest.mark.parametrize("family", PIPELINE_FAMILIES)
def test_offloaded_towers_encode_the_same_and_rest_in_host_memory(family, tiny_dirs):
    want = _tensors(_policy(tiny_dirs, family, False).family.encode_prompts(PROMPTS))
    fam = _policy(tiny_dirs, family, True).family
    towers = fam.text_towers()
    assert towers and all(k.startswith(fam.conditioning_towers) for k in towers)
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, a: seen.append(next(m.parameters()).device)) for m in towers.values()]
    got = _tensors(fam.encode_prompts(PROMPTS))
    for h in hooks:
        h.remove()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert seen and all(d == fam._encode_device for d in seen)  # encoded where the towers were loaded
    assert all(p.device.type == "cpu" for m in towers.values() for p in m.parameters())


def test_the_towers_go_back_when_encoding_fails(tiny_dirs):
    fam = _policy(tiny_dirs, "sd3", True).family
    with pytest.raises(RuntimeError, match="tokenizer broke"):
        with fam.text_towers_resident():
            raise RuntimeError("tokenizer broke")
    assert all(p.device.type == "cpu" for m in fam.text_towers().values() for p in m.parameters())


def test_a_family_without_separate_towers_is_refused_before_anything_runs(tiny_dirs):
    path, overrides = tiny_dirs("janus_pro")
    cfg = load_config(None, [*(f"{k}={v}" for k, v in overrides.items()), "model.offload_text_encoders=true",
                             "algorithm=token_grpo"])
    with pytest.raises(PreflightError, match="janus_pro family has no separate text encoder"):
        preflight(cfg)
