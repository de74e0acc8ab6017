"""benchmarks/gpu_smoke.py — the check a machine with a GPU runs — takes the same path on CPU
with a tiny model: one iteration of the real flow, every stage timed, a version published."""

import importlib.util
import sys
from argparse import Namespace
from pathlib import Path

import pytest


def _load_script():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_smoke.py"
    spec = importlib.util.spec_from_file_location("gpu_smoke", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_smoke"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("family", ["sd3", "sd15", "sdxl", "flux1", "flux1_kontext", "qwen_image", "sana", "flux2", "wan",
                                    "wan_a14b", "wan_i2v", "z_image", "hunyuan_video", "skyreels_i2v", "pixart_sigma", "qwen_image_edit", "qwen_image_edit_plus", "qwen_image21", "hunyuan_video15", "hunyuan_video15_i2v", "ltx_video", "mochi", "cogvideox", "wan_ti2v", "ltx_video_i2v", "cogvideox_i2v", "cosmos2", "cosmos2_v2w", "cosmos25", "glm_image", "glm_image_ar", "hunyuan_image", "ltx2", "ltx2_i2v",
                                    "janus_pro", "janus_pro+cot", "sd3+srpo", "sd3+draft"])
def test_gpu_smoke_runs_one_real_iteration_on_cpu(family, tmp_path, prefect_harness):
    smoke = _load_script()
    family, _, variant = family.partition("+")
    args = Namespace(family=family, layers=None, tiny=True, device="cpu", dtype="float32", resolution=512, steps=4,
                     group_size=4, prompts=2, micro_batch=4, workdir=str(tmp_path), cot=8 if variant == "cot" else 0,
                     srpo=variant == "srpo", draft=2 if variant == "draft" else 0)
    res = smoke.run(args)
    assert res["family"] == family
    if variant in ("srpo", "draft"):  # the reward-gradient update, against the CLIP the script built
        assert res["algorithm"] == variant
    assert set(res["stage_s"]) == set(smoke.STAGES) and all(s > 0 for s in res["stage_s"].values())
    assert res["images_per_s"] > 0 and res["policy_version"] == 1 and res["samples"] == 8
