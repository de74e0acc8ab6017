"""`dvc repro` runs the whole pipeline (prompts → pretrain → train → dpo → evaluate, export) on a tiny
parameter set, on CPU; `dvc metrics show` and `dvc plots show` read what the stages wrote; the
stages track pointer files, not the Lance tables."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lance
import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "prompts": {"seed": 0},
    "pretrain": {"seed": 0, "vae_steps": 3, "denoiser_steps": 3, "threads": 2},
    "train": {"reward": "jpeg_compressibility", "iterations": 2, "seed": 0, "group_size": 2,
              "prompts_per_iteration": 8, "eval_every": 1, "eval_per_category": 1},
    "dpo": {"steps": 2, "pairs_per_step": 4, "eval_per_category": 1},
    "evaluate": {"per_category": 1},
}


def _dvc(args, cwd, env):
    res = subprocess.run([str(Path(sys.executable).parent / "dvc"), *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res.stdout


def test_dvc_repro_runs_the_pipeline_end_to_end(tmp_path):
    assert yaml.safe_load((ROOT / "params.yaml").read_text()).keys() == TINY.keys()  # the same parameter groups
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    shutil.copy(ROOT / ".dvcignore", tmp_path / ".dvcignore")
    code_deps = {d for st in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].values()
                 for d in st.get("deps", []) if d.startswith("pixrl/")}
    for dep in code_deps:  # the stages' code dependencies, hashed by DVC (the command runs the installed package)
        shutil.copytree(ROOT / dep, tmp_path / dep, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(TINY))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)  # each stage is its own process with Prefect's ephemeral API
    _dvc(["init", "--no-scm", "-q"], tmp_path, env)
    _dvc(["repro"], tmp_path, env)

    lock = yaml.safe_load((tmp_path / "dvc.lock").read_text())["stages"]
    assert set(lock) == {"prompts", "pretrain", "train", "dpo", "evaluate", "export"}
    tracked = [o["path"] for st in lock.values() for o in st.get("outs", [])]
    assert not any("lance" in p or p.startswith("work") for p in tracked)  # pointer files, not the stores
    train_ref = json.loads((tmp_path / "dvc/train/ref.json").read_text())
    assert lance.dataset(train_ref["table_uri"], version=train_ref["table_version"]).count_rows() == 2 * 16
    dpo_ref = json.loads((tmp_path / "dvc/dpo/ref.json").read_text())
    assert dpo_ref["sources"][0]["run_ids"] == [train_ref["run_id"]]
    # one registered model for the experiment: train published versions 1, 2; the DPO run version 3
    assert dpo_ref["model"] == train_ref["model"] and (train_ref["model_version"], dpo_ref["model_version"]) == (2, 3)
    assert dpo_ref["best_model_version"] == 3 and train_ref["best_model_version"] in (1, 2)
    exported = json.loads((tmp_path / "models/dvc_dpo/pixrl_export.json").read_text())  # the DPO policy, for diffusers
    assert exported["format"] == "diffusers-pipeline" and exported["source"]["version"] == 3
    assert (tmp_path / "models/dvc_dpo/transformer/diffusion_pytorch_model.safetensors").is_file()

    metrics = json.loads(_dvc(["metrics", "show", "--json"], tmp_path, env))
    flat = json.dumps(metrics)
    for key in ("reward_final", "heldout_after", "pairs", "accuracy"):
        assert f'"{key}"' in flat, key
    _dvc(["plots", "show", "--json"], tmp_path, env)
    assert "No changes" in _dvc(["status"], tmp_path, env) or "up to date" in _dvc(["status"], tmp_path, env)
    # a change to the miniature's code makes the pretrain stage (and what follows) stale
    changed = tmp_path / "pixrl/models/mini/pretrain.py"
    changed.write_text(changed.read_text() + "\n# edited\n")
    assert "pretrain" in _dvc(["status"], tmp_path, env)
