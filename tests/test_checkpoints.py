"""Checkpoints are complete or absent, and a corrupted one is never loaded; retention can reduce one to its
weights without breaking verification; a published checkpoint is stored once (real MLflow, sqlite)."""

from pathlib import Path

import mlflow
import pytest
import torch
from safetensors.torch import load_file

from pixrl.artifacts.checkpoints import (CheckpointPruned, CorruptCheckpoint, load_optimizer_state, load_weights,
                                         read_counters, require_full_checkpoint, save_checkpoint, strip_to_weights,
                                         verify_checkpoint, weights_only_reason)
from pixrl.artifacts.tracking import Tracker, default_tracking_uri


def _save(d):
    w = {"a": torch.arange(6.0).reshape(2, 3)}
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    return save_checkpoint(d, w, opt.state_dict(), {"iteration": 3}, {"x": 1})


def test_roundtrip_and_manifest(tmp_path):
    ref = _save(tmp_path / "it_0003")
    assert ref.iteration == 3 and read_counters(tmp_path / "it_0003")["checkpoint_id"] == ref.checkpoint_id
    assert torch.equal(load_weights(tmp_path / "it_0003")["a"], torch.arange(6.0).reshape(2, 3))
    assert "param_groups" in load_optimizer_state(tmp_path / "it_0003")
    assert set(verify_checkpoint(tmp_path / "it_0003")["files"]) == {
        "trainable.safetensors", "optimizer.pt", "rng.pt", "counters.json", "config.json"}
    assert not list(tmp_path.glob("*.staging-*"))
    with pytest.raises(FileExistsError):
        _save(tmp_path / "it_0003")


def test_corruption_is_detected(tmp_path):
    _save(tmp_path / "c")
    f = tmp_path / "c" / "trainable.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        load_weights(tmp_path / "c")
    (tmp_path / "c" / "manifest.json").unlink()
    with pytest.raises(CorruptCheckpoint, match="incomplete"):
        verify_checkpoint(tmp_path / "c")


# --- weights-only checkpoints (retention) ----------------------------------------------------------
def test_strip_to_weights_keeps_a_verifiable_loadable_checkpoint(tmp_path):
    d = tmp_path / "it_0009"
    _save(d)
    weights = load_weights(d)
    assert strip_to_weights(d, "keep_full=3, weights_every=10")
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "counters.json", "manifest.json",
                                                   "trainable.safetensors"]
    assert set(verify_checkpoint(d)["files"]) == {"trainable.safetensors", "counters.json", "config.json"}
    assert torch.equal(load_weights(d)["a"], weights["a"]) and read_counters(d)["iteration"] == 3
    assert weights_only_reason(d) == "keep_full=3, weights_every=10"
    assert not strip_to_weights(d, "other")  # idempotent: nothing left to do, the reason is kept
    assert weights_only_reason(d) == "keep_full=3, weights_every=10"
    with pytest.raises(CheckpointPruned) as exc:
        load_optimizer_state(d)
    assert str(exc.value).startswith(
        "checkpoint it_0009's optimizer state (optimizer.pt) and RNG state (rng.pt) were pruned by retention "
        "(keep_full=3, weights_every=10); loading its optimizer state")


def test_strip_to_weights_interrupted_is_finished_by_the_next_call(tmp_path, monkeypatch):
    d = tmp_path / "it_0019"
    _save(d)
    real_unlink = Path.unlink

    def crash(self, *a, **k):
        raise OSError("killed between the manifest and the deletes")

    monkeypatch.setattr(Path, "unlink", crash)
    with pytest.raises(OSError, match="killed"):
        strip_to_weights(d, "keep_full=3, weights_every=10")
    monkeypatch.setattr(Path, "unlink", real_unlink)
    verify_checkpoint(d)  # the manifest (written first) already describes a valid weights-only checkpoint
    assert (d / "optimizer.pt").exists() and weights_only_reason(d)
    assert strip_to_weights(d, "keep_full=3, weights_every=10")  # the stray files go now
    assert not (d / "optimizer.pt").exists() and not (d / "rng.pt").exists()


def test_require_full_checkpoint_names_what_is_missing(tmp_path):
    d = tmp_path / "it_0004"
    _save(d)
    require_full_checkpoint(d, "replaying iteration 5's update")  # whole: fine
    strip_to_weights(d, "keep_full=3, weights_every=10")
    with pytest.raises(CheckpointPruned, match=r"checkpoint it_0004's optimizer state \(optimizer.pt\) and RNG "
                                               r"state \(rng.pt\) were pruned by retention \(keep_full=3, "
                                               r"weights_every=10\); replaying iteration 5's update needs them"):
        require_full_checkpoint(d, "replaying iteration 5's update")
    with pytest.raises(CheckpointPruned, match=r"checkpoint it_0003 .* does not exist.*replaying iteration 4's "
                                               r"update needs its weights and optimizer state"):
        require_full_checkpoint(tmp_path / "it_0003", "replaying iteration 4's update")


# --- stored once: the registered version is the checkpoint directory --------------------------------
def _tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0


def test_published_version_is_the_checkpoint_directory_not_a_copy(tmp_path):
    wd = tmp_path / "work"
    wd.mkdir()
    tracker = Tracker(default_tracking_uri(wd))
    run_id = tracker.start_run("exp", "r", {})
    tracker.log_dict(run_id, {"a": 1}, "config/resolved.json")  # ordinary run artifacts still go to mlruns/
    before = _tree_bytes(wd / "mlruns")
    torch.manual_seed(0)
    weights = {"blocks.0.weight": torch.randn(64, 64), "blocks.0.bias": torch.randn(64)}
    opt = torch.optim.AdamW([torch.nn.Parameter(w.clone()) for w in weights.values()])
    ckpt_dir = wd / "checkpoints" / "r" / run_id / "it_0000"
    ck = save_checkpoint(ckpt_dir, weights, opt.state_dict(), {"iteration": 0}, {"x": 1})
    ref = tracker.publish(run_id, ckpt_dir, 0, "exp-policy", ck.checkpoint_id, {"run_name": "r"})
    assert (ref.model_name, ref.version, ref.checkpoint_id) == ("exp-policy", 1, ck.checkpoint_id)
    assert ref.source == ckpt_dir.resolve().as_uri()
    assert _tree_bytes(wd / "mlruns") == before  # nothing of the checkpoint was copied into MLflow's store
    assert not list((wd / "mlruns").rglob("*.safetensors"))
    assert tracker.version("exp-policy", 1) == ref

    mlflow.set_tracking_uri(tracker.uri)  # MLflow's own resolution of models:/NAME/V reaches the directory
    got = Path(mlflow.artifacts.download_artifacts(artifact_uri="models:/exp-policy/1", dst_path=str(tmp_path / "m")))
    verify_checkpoint(got)
    for k, v in load_file(str(got / "trainable.safetensors")).items():
        assert torch.equal(v, weights[k])

    dl = tracker.download(ref, wd / "cache" / "policies" / "exp-policy-v1.dl")  # what the engine caches
    assert dl.name == "it_0000" and verify_checkpoint(dl)["checkpoint_id"] == ck.checkpoint_id
    assert all(torch.equal(load_weights(dl)[k], weights[k]) for k in weights)
    assert (dl / "optimizer.pt").stat().st_ino == (ckpt_dir / "optimizer.pt").stat().st_ino  # linked, not copied


def test_publish_falls_back_to_a_copy_where_an_mlflow_server_refuses_local_sources(tmp_path, monkeypatch):
    from mlflow.exceptions import MlflowException

    tracker = Tracker(default_tracking_uri(tmp_path))
    run_id = tracker.start_run("exp", "r", {})
    ckpt_dir = tmp_path / "checkpoints" / "r" / run_id / "it_0002"
    ck = _save(ckpt_dir)
    real = tracker.client.create_model_version

    def server_like(name, source, run_id=None, **kw):  # what mlflow.server.handlers._validate_source_run says
        if source.startswith("file://") and "/mlruns/" not in source:
            raise MlflowException(f"Invalid model version source: '{source}'. To use a local path as a model version "
                                  "source, the run_id request parameter has to be specified and the local path has "
                                  "to be contained within the artifact directory of the run specified by the run_id.")
        return real(name, source, run_id=run_id, **kw)

    monkeypatch.setattr(tracker.client, "create_model_version", server_like)
    ref = tracker.publish(run_id, ckpt_dir, 2, "exp-policy", ck.checkpoint_id, {})
    assert ref.source.endswith("/mlruns/exp/" + run_id + "/artifacts/checkpoints/it_0002")
    assert tracker.client.get_model_version("exp-policy", "1").tags["pixrl.storage"] == "mlflow-artifacts"
    assert torch.equal(load_weights(tracker.download(ref, tmp_path / "dl"))["a"], torch.arange(6.0).reshape(2, 3))
