"""`model.sigmas`: a distilled checkpoint's σ list (LTX-2's 8 DISTILLED_SIGMA_VALUES, a turbo
model's few steps) as every sampling grid. For each family whose pipeline takes `sigmas=`, the
family's (σ, timestep) grid is exactly the one its diffusers pipeline steps through when given the
same list — recorded from the pipeline's own run (its step callback and its scheduler), under each
family's shift (dynamic, empirical, terminal); a run records the list in every row's recipe and
stores that grid; and every misuse is refused naming the fix."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.cli import app
from pixrl.config.model import ModelConfig
from pixrl.models.base import ModelLoadError
from pixrl.models.registry import get_family

SIGMAS = [1.0, 0.9, 0.7, 0.4]
FAMILIES = ["sd3", "flux1", "qwen_image", "flux2", "flux2_klein", "lumina2", "z_image", "ltx2"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sigmas")
    return {name: (root / name, get_family(name).write_tiny(root / name, seed=0)) for name in FAMILIES}


def _load(tiny_dirs, name: str, **options):
    path, overrides = tiny_dirs[name]
    kw = {k.removeprefix("model.").removeprefix("av_guidance."): v for k, v in overrides.items()
          if k not in ("model.family", "model.path")}
    return get_family(name).load(path, **kw, **options)


def _pipeline_grid(fam, sigmas: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(σ, timesteps) the family's diffusers pipeline steps through when given `sigmas=`: the
    timesteps its step callback sees, the σ its scheduler holds after the run."""
    seen: list[float] = []

    def record(pipe, i, t, kwargs):
        seen.append(float(t))
        return {}

    call = dict(prompt=["a red circle"], num_inference_steps=len(sigmas), sigmas=sigmas, guidance_scale=1.0,
                height=fam.height, width=fam.width, output_type="latent", callback_on_step_end=record,
                callback_on_step_end_tensor_inputs=[])
    if fam.max_sequence_length:
        call["max_sequence_length"] = fam.max_sequence_length
    if getattr(fam, "video", False):
        call["num_frames"] = fam.frames
    fam.pipe(**call)
    return fam.pipe.scheduler.sigmas.float().cpu(), torch.tensor(seen)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_grid_is_the_one_the_pipeline_steps_through_given_the_same_sigmas(tiny_dirs, name):
    fam = _load(tiny_dirs, name, sigmas=SIGMAS)
    sigmas, timesteps = fam.schedule(len(SIGMAS))
    ref_sigmas, ref_timesteps = _pipeline_grid(fam, SIGMAS)
    assert torch.equal(timesteps.cpu(), ref_timesteps) and torch.equal(sigmas.cpu(), ref_sigmas)
    assert sigmas[-1] == 0 and len(timesteps) == len(SIGMAS)
    default = _load(tiny_dirs, name).schedule(len(SIGMAS))[1]
    assert (default - timesteps).abs().max() > 1.0  # the list is what moved the grid
    with pytest.raises(ValueError, match="model.sigmas holds 4 noise levels and 6 steps.*sampling.steps"):
        fam.schedule(6)


def test_a_run_records_the_list_and_stores_its_grid(tiny_checkpoint, tmp_path, prefect_harness):
    import lance

    res = CliRunner().invoke(app, ["train", "--iterations", "1", "--run", "turbo", "reward=jpeg_compressibility",
                                   *tiny_overrides(tiny_checkpoint, tmp_path), f"model.sigmas={SIGMAS}"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    t = lance.dataset(json.loads(res.stdout.strip().splitlines()[-1])["table_uri"]).to_table()
    assert t.num_rows == 8 and all(json.loads(r)["sigmas"] == SIGMAS for r in t["recipe"].to_pylist())
    fam = get_family("sd3").load(tiny_checkpoint, max_sequence_length=0, sigmas=SIGMAS)
    sigmas, timesteps = fam.schedule(4)
    assert all(torch.equal(torch.tensor(row), sigmas) for row in t["sigmas"].to_pylist())
    assert all(torch.equal(torch.tensor(row), timesteps) for row in t["timesteps"].to_pylist())


def test_misuse_is_refused_naming_the_fix(tiny_checkpoint, tiny_dirs, tmp_path):
    with pytest.raises(ValueError, match="strictly decreasing"):
        ModelConfig(sigmas=[1.0, 0.5, 0.7])
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        ModelConfig(sigmas=[1.5, 0.5])
    runner = CliRunner()
    res = runner.invoke(app, ["train", "--iterations", "1", *tiny_overrides(tiny_checkpoint, tmp_path / "a"),
                              f"model.sigmas={SIGMAS[:3]}"])
    assert res.exit_code != 0 and "model.sigmas holds 3 noise levels" in res.output, res.output
    assert "sampling.steps and sampling.eval_steps to 3" in res.output and not (tmp_path / "a").exists()
    with pytest.raises(ModelLoadError, match="model.sigmas: the wan family has no such setting"):
        get_family("wan").load(tiny_dirs["sd3"][0], sigmas=SIGMAS)
    fam = _load(tiny_dirs, "flux1")
    fam.pipe.scheduler.register_to_config(use_flow_sigmas=True)  # a scheduler that places its own
    fam.pipe.save_pretrained(str(tmp_path / "flow-sigmas"))
    with pytest.raises(ModelLoadError, match="use_flow_sigmas.*unset model.sigmas"):
        get_family("flux1").load(tmp_path / "flow-sigmas", max_sequence_length=64, resolution=32, sigmas=SIGMAS)
