"""`pixrl runs` compares runs from MLflow: one row per run with rewards, held-out accuracy,
throughput, duration and status (two real runs, one with periodic evaluation)."""

import json

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.artifacts.tracking import Tracker
from pixrl.cli import app
from pixrl.stages.inference import PolicyNotFound, run_policy_ref


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


def test_one_registered_model_per_experiment(tiny_checkpoint, tmp_path, prefect_harness):
    """Runs of one experiment publish versions of one registered model (`<experiment>-policy`):
    `rollout` follows the latest publish of any run, `champion` the best held-out evaluation across
    runs; a run's own newest/best versions stay reachable by run name. Another experiment gets its own."""
    ids = {}
    for name, exp in (("a", "cmp"), ("b", "cmp"), ("c", "other")):
        res = CliRunner().invoke(app, ["train", "-n", "2", "--run", name, "reward=jpeg_compressibility",
                                       f"run.experiment={exp}",
                                       *tiny_overrides(tiny_checkpoint, tmp_path, **{"run.eval_every": 1,
                                                                                     "run.eval_per_category": 1})])
        assert res.exit_code == 0, res.output
        ids[name] = json.loads(res.stdout.strip().splitlines()[-1])["run_id"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert sorted(m.name for m in client.search_registered_models()) == ["cmp-policy", "other-policy"]
    cmp = client.search_model_versions("name='cmp-policy'")
    assert sorted((v.run_id, v.tags["iteration"]) for v in cmp) == sorted(
        (ids[n], str(i)) for n in ("a", "b") for i in (0, 1))
    assert [v.run_id for v in client.search_model_versions("name='other-policy'")] == [ids["c"]] * 2
    by_version = {int(v.version): v for v in cmp}
    rollout = client.get_model_version_by_alias("cmp-policy", "rollout")
    assert rollout.run_id == ids["b"] and rollout.tags["iteration"] == "1"  # the latest publish
    acc = {v: float(mv.tags["heldout_accuracy"]) for v, mv in by_version.items()}
    best = max(acc, key=lambda v: (acc[v], -v))  # strictly better moves it: the first of the best
    assert int(client.get_model_version_by_alias("cmp-policy", "champion").version) == best

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    a_latest = run_policy_ref(tracker, "a", "rollout", str(tmp_path))
    assert (a_latest.model_name, by_version[a_latest.version].run_id) == ("cmp-policy", ids["a"])
    assert by_version[a_latest.version].tags["iteration"] == "1"
    a_best = run_policy_ref(tracker, "a", "champion", str(tmp_path))
    a_acc = {v: a for v, a in acc.items() if by_version[v].run_id == ids["a"]}
    assert a_best.version == max(a_acc, key=lambda v: (a_acc[v], -v))
    with pytest.raises(PolicyNotFound, match="no run named 'zzz'"):
        run_policy_ref(tracker, "zzz", "rollout", str(tmp_path))
