"""Checkpoints are complete or absent, and a corrupted one is never loaded."""

import pytest
import torch

from pixrl.artifacts.checkpoints import (CorruptCheckpoint, load_optimizer_state, load_weights, read_counters,
                                         save_checkpoint, verify_checkpoint)


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
