"""The embedded miniature and the eval / generate commands."""

import json

import numpy as np
from PIL import Image
from typer.testing import CliRunner

from pixrl.cli import app
from pixrl.engines.assets import resolve_asset
from pixrl.models.registry import get_family


def test_embedded_miniature_loads_through_the_sd3_family_path():
    path = resolve_asset("builtin:mini_shapes")
    fam = get_family("sd3").load(path, max_sequence_length=0)
    assert type(fam.transformer).__name__ == "SD3Transformer2DModel"
    assert type(fam.vae).__name__ == "AutoencoderKL"
    assert type(fam.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    size = sum(p.stat().st_size for p in path.rglob("*.safetensors"))
    assert size <= 30e6
    ids = fam.pipe.tokenizer("a blue circle above a red triangle")["input_ids"]
    assert len(ids) == 2 + 7  # one token per word: the tokenizer covers the prompt vocabulary


def test_eval_json_and_generate(tiny_checkpoint, tmp_path):
    r = CliRunner().invoke(app, ["eval", "--checkpoint", str(tiny_checkpoint), "--split", "heldout",
                                 "--per-category", "2", "--steps", "2", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert 0.0 <= res["accuracy"] <= 1.0 and res["n"] == 10
    assert {"two_object", "counting", "colors", "position", "color_attr"} <= set(res)
    out = tmp_path / "gen"
    r = CliRunner().invoke(app, ["generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "two yellow squares",
                                 "--prompt", "a blue circle above a red triangle", "--samples", "2",
                                 "--out", str(out), "--steps", "2"])
    assert r.exit_code == 0, r.output
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 4
    meta = json.loads(pngs[2].with_suffix(".json").read_text())
    assert meta["prompt"] == "a blue circle above a red triangle"
    assert np.asarray(Image.open(pngs[0])).shape == (16, 16, 3)
    from pixrl.datasets.prompts import load_prompt_set  # the folder is a prompt set of source images

    items = load_prompt_set(out / "prompts.jsonl", "edits")
    assert [it.prompt for it in items] == ["two yellow squares"] * 2 + ["a blue circle above a red triangle"] * 2
    assert items[3].image == pngs[3].read_bytes()
    r = CliRunner().invoke(app, ["generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "a red circle",
                                 "--out", str(tmp_path / "wide"), "--steps", "2", "--height", "8"])
    assert r.exit_code == 0, r.output
    assert np.asarray(Image.open(tmp_path / "wide" / "0000_00.png")).shape == (8, 16, 3)  # --height beside the width
    r = CliRunner().invoke(app, ["generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "a red circle",
                                 "--out", str(tmp_path / "odd"), "--width", "9"])
    assert r.exit_code == 2 and "model.height=16, model.width=9" in r.output and "a multiple of" in r.output


def test_eval_rejects_bad_arguments(tmp_path):
    r = CliRunner().invoke(app, ["eval", "--split", "validation"])
    assert r.exit_code == 2 and "heldout" in r.output
    r = CliRunner().invoke(app, ["eval", "--run", "nope", "--workdir", str(tmp_path)])
    assert r.exit_code == 2 and "no run named 'nope'" in r.output and "pixrl runs" in r.output
    r = CliRunner().invoke(app, ["generate", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "no prompts" in r.output


def test_embedded_token_miniature_loads_and_evaluates(tmp_path):
    """The token miniature (Janus classes at tiny size) loads through the janus_pro family, stays
    small, and `pixrl eval --config shapes_token_grpo` judges it with the experiment's sampling."""
    path = resolve_asset("builtin:mini_janus")
    fam = get_family("janus_pro").load(path)
    assert type(fam.model).__name__ == "JanusForConditionalGeneration"
    assert (fam.resolution, fam.image_token_count()) == (32, 64)
    assert sum(p.stat().st_size for p in path.rglob("*.safetensors")) <= 30e6
    res = CliRunner().invoke(app, ["eval", "--config", "shapes_token_grpo", "--per-category", "2", "--json",
                                   "--workdir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["n"] == 10 and 0.0 <= out["accuracy"] <= 1.0
