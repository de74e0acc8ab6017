"""`pixrl runs` compares runs from MLflow: one row per run with rewards, held-out accuracy,
throughput, duration and status (two real runs, one with periodic evaluation)."""

import json

from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.cli import app


def test_runs_lists_and_compares_two_runs(tiny_checkpoint, tmp_path, prefect_harness):
    for name, extra in (("a", {}), ("b", {"run.eval_every": 1, "run.eval_per_category": 1})):
        res = CliRunner().invoke(app, ["train", "-n", "2", "--run", name, "reward=jpeg_compressibility",
                                       *tiny_overrides(tiny_checkpoint, tmp_path, **extra)])
        assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["runs", "--workdir", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.stdout.strip().splitlines()[-1])}
    assert set(rows) == {"a", "b"}
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    for name, r in rows.items():
        hist = sorted(client.get_metric_history(r["run_id"], "reward/reward/mean"), key=lambda m: m.step)
        assert r["status"] == "FINISHED" and r["iterations"] == 2 and r["algorithm"] == "flow_grpo"
        assert r["final_reward"] == hist[-1].value and r["best_reward"] == max(m.value for m in hist)
        assert r["images_per_s"] > 0 and r["duration_s"] > 0
    assert rows["a"]["heldout"] is None and 0.0 <= rows["b"]["heldout"] <= 1.0
    assert "pixrl runs" in res.output
    for r in rows.values():  # every run carries the same comparison tags
        tags = client.get_run(r["run_id"]).data.tags
        for key in ("pixrl.family", "pixrl.algorithm", "pixrl.reward", "pixrl.dataset_version", "git.commit",
                    "dvc.lock_sha256"):
            assert tags.get(key), key
    assert len({client.get_run(r["run_id"]).data.tags["pixrl.dataset_version"] for r in rows.values()}) == 1
