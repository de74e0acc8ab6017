"""Training checkpoints: trainable weights (adapter or full module) as safetensors, optimizer
state, RNG states, counters and the resolved config — written to a staging directory and
renamed into place, so a checkpoint is complete or absent. A manifest of SHA-256 checksums is
written last; a checkpoint that does not match it is never loaded or published."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "trainable.safetensors"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
COUNTERS = "counters.json"
CONFIG = "config.json"
MANIFEST = "manifest.json"


class CorruptCheckpoint(RuntimeError):
    """A checkpoint whose files are missing or do not match their manifest."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_checkpoint(ckpt_dir: Path) -> dict:
    """Check every file against the manifest; returns the manifest."""
    ckpt_dir = Path(ckpt_dir)
    mf = ckpt_dir / MANIFEST
    if not mf.is_file():
        raise CorruptCheckpoint(f"{ckpt_dir} has no {MANIFEST}: incomplete or not a pixrl checkpoint")
    manifest = json.loads(mf.read_text())
    for name, entry in manifest["files"].items():
        f = ckpt_dir / name
        if not f.is_file() or f.stat().st_size != entry["bytes"] or _sha256(f) != entry["sha256"]:
            raise CorruptCheckpoint(f"{f} is missing or does not match its checksum; the checkpoint is corrupt "
                                    f"and will not be loaded or published")
    return manifest


@dataclass(frozen=True)
class CheckpointRef:
    uri: str  # local directory
    checkpoint_id: str
    iteration: int

    def to_dict(self) -> dict:
        return {"uri": self.uri, "checkpoint_id": self.checkpoint_id, "iteration": self.iteration}


def save_checkpoint(out_dir: Path, weights: dict[str, torch.Tensor], optimizer_state: dict,
                    counters: dict, config: dict) -> CheckpointRef:
    if out_dir.exists():
        raise FileExistsError(f"checkpoint {out_dir} already exists; refusing to overwrite it")
    staging = out_dir.with_name(out_dir.name + f".staging-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(staging / WEIGHTS))
        torch.save(optimizer_state, staging / OPTIMIZER)
        torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
                   staging / RNG)
        ckpt_id = uuid.uuid4().hex
        (staging / COUNTERS).write_text(json.dumps({**counters, "checkpoint_id": ckpt_id}, indent=2))
        (staging / CONFIG).write_text(json.dumps(config, indent=2))
        files = {f.name: {"sha256": _sha256(f), "bytes": f.stat().st_size} for f in sorted(staging.iterdir())}
        (staging / MANIFEST).write_text(json.dumps({"checkpoint_id": ckpt_id, "files": files}, indent=2))
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return CheckpointRef(str(out_dir), ckpt_id, int(counters.get("iteration", -1)))


def read_counters(ckpt_dir: Path) -> dict:
    return json.loads((Path(ckpt_dir) / COUNTERS).read_text())


def load_weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    verify_checkpoint(ckpt_dir)
    return load_file(str(Path(ckpt_dir) / WEIGHTS))


def load_optimizer_state(ckpt_dir: Path) -> dict:
    verify_checkpoint(ckpt_dir)
    return torch.load(Path(ckpt_dir) / OPTIMIZER, weights_only=False)
