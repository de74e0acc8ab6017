"""Checkpoint retention (`run.retention`, and its deprecated alias `run.keep_checkpoints`): the
ladder (newest K whole, every Nth weights-only, evaluated and aliased whole, the rest deleted)
applied to the one stored copy of each checkpoint, idempotent and finished after a crash; pruned
versions refuse to load with a message; a weights-only checkpoint names what replay misses.
Real MLflow (sqlite) and safetensors checkpoints; the last test runs the real flow (Prefect,
Lance, a tiny SD3 model)."""

import json
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.artifacts import retention
from pixrl.artifacts.checkpoints import (CheckpointPruned, load_optimizer_state, load_weights,
                                         require_full_checkpoint, save_checkpoint, verify_checkpoint)
from pixrl.artifacts.retention import (FULL, PRUNED, WEIGHTS_ONLY, RunRetention, VersionInfo, apply_retention,
                                       classify, prune_checkpoints)
from pixrl.artifacts.tracking import (PRUNED_TAG, WEIGHTS_ONLY_TAG, PrunedCheckpoint, Tracker,
                                      default_tracking_uri)
from pixrl.cli import app
from pixrl.config.schema import ExperimentConfig, RetentionConfig

MODEL = "exp-policy"
LADDER = RetentionConfig(keep_full=3, weights_every=10)


def _weights(it: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(it)
    return {"blocks.0.weight": torch.randn(48, 48, generator=g), "blocks.0.bias": torch.randn(48, generator=g)}


def _published_run(wd: Path, n: int, legacy: bool = False) -> tuple[Tracker, str, Path]:
    """A run with versions for iterations 0..n-1, each a real checkpoint (weights, AdamW state after
    a step, RNG, counters) published through Tracker.publish (legacy: copied into mlruns/ and
    registered from there, as before checkpoints were stored once)."""
    wd.mkdir(parents=True, exist_ok=True)
    tracker = Tracker(default_tracking_uri(wd))
    run_id = tracker.start_run("exp", "r", {})
    root = wd / "checkpoints" / "r" / run_id
    if legacy:
        tracker.client.create_registered_model(MODEL)
    for it in range(n):
        w = _weights(it)
        params = [torch.nn.Parameter(v.clone()) for v in w.values()]
        opt = torch.optim.AdamW(params)
        sum(p.sum() for p in params).backward()
        opt.step()
        ck = save_checkpoint(root / f"it_{it:04d}", w, opt.state_dict(), {"iteration": it}, {"run": {}})
        if legacy:
            tracker.client.log_artifacts(run_id, ck.uri, f"checkpoints/it_{it:04d}")
            mv = tracker.client.create_model_version(
                MODEL, source=tracker.artifact_uri(run_id, f"checkpoints/it_{it:04d}"), run_id=run_id,
                tags={"checkpoint_id": ck.checkpoint_id, "iteration": str(it)})
            tracker.client.set_registered_model_alias(MODEL, "rollout", mv.version)
        else:
            tracker.publish(run_id, root / f"it_{it:04d}", it, MODEL, ck.checkpoint_id, {"run_name": "r"})
    return tracker, run_id, root


def _state(tracker: Tracker, run_id: str, wd: Path) -> tuple:
    """Everything retention may change: files under checkpoints/ and mlruns/, and the version tags."""
    files = sorted(str(f.relative_to(wd)) for top in ("checkpoints", "mlruns") for f in (wd / top).rglob("*")
                   if f.is_file() and "/cache/" not in str(f))
    tags = sorted((mv.tags.get("iteration"), tuple(sorted(mv.tags.items())))
                  for mv in tracker.run_versions(MODEL, run_id))
    return files, tags


def _kinds(root: Path, n: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {FULL: [], WEIGHTS_ONLY: [], PRUNED: []}
    for it in range(n):
        d = root / f"it_{it:04d}"
        out[PRUNED if not d.exists() else FULL if (d / "optimizer.pt").exists() else WEIGHTS_ONLY].append(it)
    return out


# 25 iterations; 4 and 14 evaluated, 6 holds an alias; keep_full=3, weights_every=10
EXPECTED = {FULL: [4, 6, 14, 22, 23, 24], WEIGHTS_ONLY: [9, 19],
            PRUNED: [0, 1, 2, 3, 5, 7, 8, 10, 11, 12, 13, 15, 16, 17, 18, 20, 21]}


def _evaluate_and_alias(tracker: Tracker, run_id: str) -> None:
    assert tracker.record_evaluation(tracker.find_version(MODEL, run_id, 4), 0.5, 8)
    assert tracker.record_evaluation(tracker.find_version(MODEL, run_id, 14), 0.75, 8)  # champion moves to 14
    tracker.move_alias(tracker.find_version(MODEL, run_id, 6), "pinned")


def test_default_policy_and_the_deprecated_keep_checkpoints_alias():
    run = ExperimentConfig().run
    assert run.keep_checkpoints is None and run.retention == RetentionConfig(keep_full=3, weights_every=10,
                                                                             keep_evaluated=True)
    legacy = ExperimentConfig.model_validate({"run": {"keep_checkpoints": 1, "retention": {"weights_every": 5}}})
    assert legacy.run.retention == RetentionConfig(keep_full=1, weights_every=5)
    assert ExperimentConfig.model_validate(legacy.model_dump(mode="json")).run.retention.keep_full == 1
    with pytest.raises(ValueError, match="deprecated alias of run.retention.keep_full"):
        ExperimentConfig.model_validate({"run": {"keep_checkpoints": 1, "retention": {"keep_full": 4}}})


def test_classify_is_the_ladder():
    vs = [VersionInfo(version=it + 1, iteration=it, evaluated=it == 4, aliased=it == 6) for it in range(25)]
    got = classify(vs, LADDER)
    assert {k: sorted(v.iteration for v in vs if got[v.version] == k) for k in (FULL, WEIGHTS_ONLY, PRUNED)} \
        == EXPECTED | {FULL: [4, 6, 22, 23, 24], PRUNED: sorted(EXPECTED[PRUNED] + [14])}
    assert set(classify(vs, RetentionConfig(keep_full=None)).values()) == {FULL}
    no_eval = classify(vs, RetentionConfig(keep_full=3, weights_every=0, keep_evaluated=False))
    assert sorted(v.iteration for v in vs if no_eval[v.version] == FULL) == [6, 22, 23, 24]
    assert WEIGHTS_ONLY not in no_eval.values()


def test_ladder_on_the_stored_checkpoints_and_registry(tmp_path):
    wd = tmp_path / "w"
    tracker, run_id, root = _published_run(wd, 25)
    _evaluate_and_alias(tracker, run_id)
    full_bytes = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    res = apply_retention(tracker, MODEL, run_id, LADDER, root)
    assert _kinds(root, 25) == EXPECTED
    assert sorted(res.pruned) == EXPECTED[PRUNED] and sorted(res.weights_only) == EXPECTED[WEIGHTS_ONLY]
    assert res.bytes_freed == full_bytes - sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) > 0
    assert res.metrics()["checkpoints_pruned"] == len(EXPECTED[PRUNED])
    assert {it for it, kind in res.plan.items() if kind == FULL} == set(EXPECTED[FULL])
    assert not list((wd / "mlruns").rglob("*.safetensors")) and not list((wd / "mlruns").rglob("optimizer.pt"))

    versions = {int(mv.tags["iteration"]): mv for mv in tracker.run_versions(MODEL, run_id)}
    assert sorted(versions) == list(range(25))  # every version stays registered, with its lineage tags
    for it, mv in versions.items():
        ref = tracker.version(MODEL, int(mv.version))
        if it in EXPECTED[PRUNED]:
            assert mv.tags[PRUNED_TAG] == "retention (keep_full=3, weights_every=10)"
            with pytest.raises(PrunedCheckpoint, match=rf"models:/{MODEL}/{mv.version} .*iteration {it}\) was "
                                                       r"pruned by retention \(keep_full=3, weights_every=10\)"):
                tracker.download(ref, tmp_path / "dl" / str(it))
            continue
        assert PRUNED_TAG not in mv.tags
        assert (WEIGHTS_ONLY_TAG in mv.tags) == (it in EXPECTED[WEIGHTS_ONLY])
        got = tracker.download(ref, tmp_path / "dl" / str(it))  # weights-only versions load too
        verify_checkpoint(got)
        assert all(torch.equal(load_weights(got)[k], v) for k, v in _weights(it).items())
        if it in EXPECTED[FULL]:
            load_optimizer_state(got)

    mlflow.set_tracking_uri(tracker.uri)  # a weights-only version through MLflow's own models:/ resolution
    got = Path(mlflow.artifacts.download_artifacts(f"models:/{MODEL}/{versions[19].version}",
                                                   dst_path=str(tmp_path / "m19")))
    assert all(torch.equal(load_file(str(got / "trainable.safetensors"))[k], v) for k, v in _weights(19).items())


def test_retention_is_idempotent_and_a_crash_is_finished_by_the_next_call(tmp_path, monkeypatch):
    tracker, run_id, root = _published_run(tmp_path / "w", 25)
    _evaluate_and_alias(tracker, run_id)
    real_rmtree = retention.shutil.rmtree
    calls = []

    def dies_on_the_fourth(path, *a, **k):
        calls.append(path)
        if len(calls) == 4:
            raise KeyboardInterrupt("killed mid-retention")
        real_rmtree(path, *a, **k)

    monkeypatch.setattr(retention.shutil, "rmtree", dies_on_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        apply_retention(tracker, MODEL, run_id, LADDER, root)
    monkeypatch.setattr(retention.shutil, "rmtree", real_rmtree)
    half = _kinds(root, 25)
    assert half[PRUNED] == [0, 1, 2] and (root / "it_0003").exists()  # killed while deleting iteration 3
    assert PRUNED_TAG in tracker.client.get_model_version(MODEL, tracker.find_version(MODEL, run_id, 3).version).tags
    # (the tag comes before the delete: never files gone without the tag saying why)
    res = apply_retention(tracker, MODEL, run_id, LADDER, root)  # finishes what the crash left
    assert _kinds(root, 25) == EXPECTED and 3 in res.pruned and 2 not in res.pruned
    state = _state(tracker, run_id, tmp_path / "w")
    again = apply_retention(tracker, MODEL, run_id, LADDER, root)
    assert (again.pruned, again.weights_only, again.bytes_freed) == ([], [], 0)
    assert _state(tracker, run_id, tmp_path / "w") == state


def test_retention_after_each_publish_walks_only_what_can_change_and_ends_as_the_full_walk(tmp_path, monkeypatch):
    """A run applies retention after every publish (RunRetention): after the first walk it looks
    only at unsettled versions, yet an alias that moves away or an evaluation that arrives later is
    honoured, and the result equals a full walk of the same registry (which then changes nothing)."""
    wd = tmp_path / "w"
    tracker, run_id, root = _published_run(wd, 1)
    run_retention = RunRetention(tracker, MODEL, run_id, LADDER, root)
    fetched = []
    real_get = tracker.client.get_model_version
    monkeypatch.setattr(tracker.client, "get_model_version", lambda name, v: fetched.append(int(v)) or real_get(name, v))
    run_retention.published(1)
    run_retention.apply()  # the first call walks everything
    for it in range(1, 25):
        w = _weights(it)
        ck = save_checkpoint(root / f"it_{it:04d}", w, {"state": {}, "param_groups": []}, {"iteration": it}, {"run": {}})
        ref = tracker.publish(run_id, root / f"it_{it:04d}", it, MODEL, ck.checkpoint_id, {"run_name": "r"})
        if it == 4:
            assert tracker.record_evaluation(tracker.find_version(MODEL, run_id, 4), 0.5, 8)
        if it == 6:
            tracker.move_alias(ref, "pinned")
        if it == 15:
            tracker.move_alias(tracker.find_version(MODEL, run_id, 14), "pinned")  # 6 is free to go now
            assert tracker.record_evaluation(tracker.find_version(MODEL, run_id, 14), 0.75, 8)
        fetched.clear()
        run_retention.published(ref.version)
        run_retention.apply()
        assert len(fetched) <= 6, f"iteration {it}: looked at versions {fetched}"  # keep_full + new + aliased
        if 9 <= it < 15:
            assert (root / "it_0006" / "optimizer.pt").exists(), f"aliased iteration 6 reduced at iteration {it}"
    kinds = _kinds(root, 25)
    assert kinds[WEIGHTS_ONLY] == [9, 19] and 6 in kinds[PRUNED] and kinds[FULL] == [4, 14, 22, 23, 24]
    state = _state(tracker, run_id, wd)
    full = apply_retention(tracker, MODEL, run_id, LADDER, root)
    assert (full.pruned, full.weights_only, full.bytes_freed) == ([], [], 0) and _state(tracker, run_id, wd) == state


def test_replay_of_a_pruned_input_names_what_is_missing(tmp_path):
    tracker, run_id, root = _published_run(tmp_path / "w", 25)
    apply_retention(tracker, MODEL, run_id, LADDER, root)
    # replaying iteration 10 continues training from checkpoint 9: weights-only now
    with pytest.raises(CheckpointPruned, match=r"checkpoint it_0009's optimizer state \(optimizer.pt\) and RNG "
                                               r"state \(rng.pt\) were pruned by retention \(keep_full=3, "
                                               r"weights_every=10\); replaying iteration 10's update needs them"):
        require_full_checkpoint(root / "it_0009", "replaying iteration 10's update")
    with pytest.raises(CheckpointPruned, match="checkpoint it_0009's optimizer state"):
        load_optimizer_state(root / "it_0009")  # the engine's own load fails the same way, not with ENOENT
    with pytest.raises(CheckpointPruned, match=r"checkpoint it_0012 .*does not exist"):
        require_full_checkpoint(root / "it_0012", "replaying iteration 13's update")
    require_full_checkpoint(root / "it_0023", "replaying iteration 24's update")  # within keep_full: whole
    # the same from the registry alone, before a fork or replay does any work
    with pytest.raises(PrunedCheckpoint, match=r"checkpoint it_0009's optimizer state \(optimizer.pt\) and RNG "
                                               r"state \(rng.pt\) were pruned by retention \(keep_full=3, "
                                               r"weights_every=10\); a fork at iteration 10 needs them"):
        tracker.check_trainable(tracker.find_version(MODEL, run_id, 9), "a fork at iteration 10")
    with pytest.raises(CheckpointPruned, match=r"was pruned by retention"):  # one except clause catches both
        tracker.check_trainable(tracker.find_version(MODEL, run_id, 12), "a fork at iteration 13")
    tracker.check_trainable(tracker.find_version(MODEL, run_id, 23), "a fork at iteration 24")


def test_versions_registered_with_a_copy_in_mlruns_are_pruned_in_both_places(tmp_path):
    wd = tmp_path / "w"
    tracker, run_id, root = _published_run(wd, 4, legacy=True)
    copies = wd / "mlruns" / "exp"
    assert len(list(copies.rglob("trainable.safetensors"))) == 4
    pruned = prune_checkpoints(tracker, MODEL, run_id, root, RetentionConfig(keep_full=1, weights_every=2))
    assert pruned == [0, 2]
    assert _kinds(root, 4) == {FULL: [3], WEIGHTS_ONLY: [1], PRUNED: [0, 2]}
    mlruns_copy = lambda it: next(copies.rglob(f"checkpoints/it_{it:04d}"), None)  # noqa: E731
    assert mlruns_copy(0) is None and mlruns_copy(2) is None
    assert not (mlruns_copy(1) / "optimizer.pt").exists() and verify_checkpoint(mlruns_copy(1))
    assert (mlruns_copy(3) / "optimizer.pt").exists()


def test_keep_checkpoints_prunes_old_iterations_but_not_evaluated_or_aliased_ones(tiny_checkpoint, tmp_path,
                                                                                 prefect_harness):
    res = CliRunner().invoke(app, ["train", "-n", "4", "--run", "kept", "reward=jpeg_compressibility",
                                   *tiny_overrides(tiny_checkpoint, tmp_path, **{
                                       "run.keep_checkpoints": 1, "run.eval_every": 2, "run.eval_per_category": 1})])
    assert res.exit_code == 0, res.output
    run_id = json.loads(res.stdout.strip().splitlines()[-1])["run_id"]
    local = tmp_path / "checkpoints" / "kept" / run_id
    # the newest resumes the run; evaluated ones (1, 3) stay: the local directory is the only copy
    assert sorted(p.name for p in local.iterdir()) == ["it_0001", "it_0003"]
    assert not list((tmp_path / "mlruns").rglob("*.safetensors"))  # nothing copied into MLflow's store
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    versions = {int(v.tags["iteration"]): v for v in client.search_model_versions(f"run_id='{run_id}'")}
    assert sorted(versions) == [0, 1, 2, 3]  # every version stays registered, with its lineage tags

    def has_weights(v) -> bool:
        return (Path(v.source.removeprefix("file://")) / "trainable.safetensors").is_file()

    for it in (1, 3):  # evaluated after iterations 2 and 4: the held-out curve's points stay loadable
        assert "heldout_accuracy" in versions[it].tags and has_weights(versions[it])
        assert PRUNED_TAG not in versions[it].tags
        assert versions[it].source == (local / f"it_{it:04d}").resolve().as_uri()
    for it in (0, 2):
        assert versions[it].tags[PRUNED_TAG] == "retention (keep_full=1, weights_every=10)"
        assert not has_weights(versions[it])
    pruned_metric = client.get_metric_history(run_id, "checkpoints_pruned")
    assert sum(m.value for m in pruned_metric) == 2  # iterations 0 and 2

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with pytest.raises(PrunedCheckpoint, match=r"was pruned by retention \(keep_full=1"):
        tracker.download(tracker.version("pixrl-policy", int(versions[2].version)), tmp_path / "dl")
    res = CliRunner().invoke(app, ["replay", "kept", "--iteration", "1", "--from-stage", "update", "--into", "f",
                                   "--workdir", str(tmp_path)])
    assert res.exit_code == 2 and "cannot fork at iteration 1" in res.output and "pruned" in res.output
    res = CliRunner().invoke(app, ["replay", "kept", "--iteration", "2", "--workdir", str(tmp_path)])
    assert res.exit_code == 2 and "retention (keep_full=1" in res.output
    res = CliRunner().invoke(app, ["eval", "--run", "kept", "--workdir", str(tmp_path), "--json",
                                   "--per-category", "1", "--steps", "2"])
    assert res.exit_code == 0, res.output  # the run's newest version still loads from the registry
