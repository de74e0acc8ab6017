"""Training checkpoints: trainable weights (adapter or full module) as safetensors — and with
algorithm.ema their moving average beside them, the version's evaluated weights — optimizer
state, RNG states, counters and the resolved config — written to a staging directory and
renamed into place, so a checkpoint is complete or absent. A manifest of SHA-256 checksums is
written last; a checkpoint that does not match it is never loaded or published.

The checkpoint directory is the only copy: the registered MLflow version points at it
(`Tracker.publish`). Retention (`retention.py`) may later reduce an old checkpoint to its weights
(`strip_to_weights`): the optimizer and RNG state, needed only to continue training from it, are
deleted and the manifest is rewritten to list what is left and record what was removed and why,
so `verify_checkpoint` still passes and a consumer that needs the removed state
(`require_full_checkpoint`, `load_optimizer_state`) fails naming it."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..errors import ExpectedError

WEIGHTS = "trainable.safetensors"
EMA = "ema.safetensors"  # algorithm.ema: the moving average of the trainable weights, its step count in the metadata
EMA_STEPS = "pixrl.ema_optimizer_steps"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
COUNTERS = "counters.json"
CONFIG = "config.json"
MANIFEST = "manifest.json"
# what only continuing training from a checkpoint needs (resume, replay of the next iteration, a
# fork from the next iteration's update); a weights-only checkpoint has dropped these
TRAINING_STATE = (OPTIMIZER, RNG)


class CorruptCheckpoint(ExpectedError, RuntimeError):
    """A checkpoint whose files are missing or do not match their manifest."""


class MissingEma(ExpectedError, FileNotFoundError):
    """Evaluation or export asked for the weight average of a checkpoint written without one."""


class CheckpointPruned(ExpectedError, RuntimeError):
    """A checkpoint (or part of it: its optimizer and RNG state) that retention deleted, asked for
    by something that needs it; the message names what is missing, why, and what needs it."""


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
                    counters: dict, config: dict, ema: tuple[dict[str, torch.Tensor], int] | None = None) -> CheckpointRef:
    """`ema`: (the weight average, the optimizer steps it has seen), written beside the weights."""
    if out_dir.exists():
        raise FileExistsError(f"checkpoint {out_dir} already exists; refusing to overwrite it")
    staging = out_dir.with_name(out_dir.name + f".staging-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(staging / WEIGHTS))
        if ema is not None:
            save_file({k: v.detach().contiguous().cpu() for k, v in ema[0].items()}, str(staging / EMA),
                      metadata={EMA_STEPS: str(int(ema[1]))})
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


def has_ema(ckpt_dir: Path) -> bool:
    return (Path(ckpt_dir) / EMA).is_file()


def load_ema(ckpt_dir: Path) -> tuple[dict[str, torch.Tensor], int]:
    """(the weight average, the optimizer steps it has seen) of a checkpoint written with algorithm.ema."""
    verify_checkpoint(ckpt_dir)
    f = Path(ckpt_dir) / EMA
    if not f.is_file():
        raise MissingEma(f"checkpoint {Path(ckpt_dir).name} ({ckpt_dir}) holds no weight average ({EMA}): it was "
                         f"written with algorithm.ema.enabled=false. Use its trained weights (--weights trained, "
                         f"or algorithm.ema.enabled=false), or train with algorithm.ema.enabled=true")
    with safe_open(str(f), "pt") as fh:
        steps = int((fh.metadata() or {}).get(EMA_STEPS, 0))
    return load_file(str(f)), steps


def check_trained_part(ckpt_dir: Path, expert: str | None) -> None:
    """Refuse a checkpoint of the other expert of a two-expert model: both hold tensors of the same
    names and shapes, so loading one into the other would go unnoticed (the config it was
    trained with says which; checkpoints from before the setting have none and pass)."""
    cfg = Path(ckpt_dir) / CONFIG
    if not cfg.is_file():
        return
    theirs = (json.loads(cfg.read_text()).get("model") or {}).get("expert")
    if theirs != expert:
        raise ValueError(f"{ckpt_dir} holds weights trained as model.expert={theirs}; this policy trains "
                         f"model.expert={expert} — use a checkpoint of that expert, or set model.expert={theirs}")


def load_optimizer_state(ckpt_dir: Path) -> dict:
    require_full_checkpoint(ckpt_dir, "loading its optimizer state (continuing training from it)")
    return torch.load(Path(ckpt_dir) / OPTIMIZER, weights_only=False)


# --- weights-only checkpoints (retention) ---------------------------------------------------------
def weights_only_reason(ckpt_dir: Path) -> str | None:
    """Why the checkpoint's training state was removed (the retention policy), or None if it is whole."""
    mf = Path(ckpt_dir) / MANIFEST
    if not mf.is_file():
        return None
    pruned = json.loads(mf.read_text()).get("weights_only")
    return pruned["reason"] if pruned else None


def require_full_checkpoint(ckpt_dir: Path, purpose: str) -> None:
    """Raise CheckpointPruned unless `ckpt_dir` is a complete checkpoint with its optimizer and RNG
    state (CorruptCheckpoint if it does not match its manifest). `purpose` says what needs it, e.g.
    "replaying iteration 5's update"; the message names what is missing and the retention policy
    that removed it. Call it before any work is done, where a stage continues training from a
    checkpoint (replay, a fork from update, resume)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointPruned(
            f"checkpoint {ckpt_dir.name} ({ckpt_dir}) does not exist: retention deleted it or it was never "
            f"written; {purpose} needs its weights and optimizer state. Keep more checkpoints whole "
            f"(run.retention.keep_full, or null to keep all).")
    manifest = verify_checkpoint(ckpt_dir)
    pruned = manifest.get("weights_only")
    if pruned:
        raise CheckpointPruned(
            f"checkpoint {ckpt_dir.name}'s {' and '.join(_describe(f) for f in pruned['removed'])} "
            f"{'was' if len(pruned['removed']) == 1 else 'were'} pruned by retention ({pruned['reason']}); "
            f"{purpose} needs {'it' if len(pruned['removed']) == 1 else 'them'}. Only its weights are kept "
            f"({ckpt_dir}). Keep more checkpoints whole with run.retention.keep_full (null: keep all).")


def _describe(name: str) -> str:
    return {OPTIMIZER: f"optimizer state ({OPTIMIZER})", RNG: f"RNG state ({RNG})"}.get(name, name)


def strip_to_weights(ckpt_dir: Path, reason: str) -> bool:
    """Reduce a checkpoint to what loading the policy needs (weights, counters, config, manifest):
    the training state (TRAINING_STATE) is deleted. Returns whether anything changed.

    Crash-safe and idempotent: the manifest is rewritten first (atomically), listing only the kept
    files and recording the removed ones and `reason`; the files are deleted after. A crash in
    between leaves a valid weights-only checkpoint with stray files, which the next call deletes."""
    ckpt_dir = Path(ckpt_dir)
    manifest = verify_checkpoint(ckpt_dir)
    changed = False
    removed = [f for f in TRAINING_STATE if f in manifest["files"]]
    if removed:
        prior = manifest.get("weights_only") or {"removed": []}
        manifest = {**manifest, "files": {k: v for k, v in manifest["files"].items() if k not in removed},
                    "weights_only": {"removed": sorted(set(prior["removed"]) | set(removed)),
                                     "reason": prior.get("reason", reason)}}
        tmp = ckpt_dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=2))
        os.replace(tmp, ckpt_dir / MANIFEST)
        changed = True
    for name in manifest.get("weights_only", {}).get("removed", []):
        f = ckpt_dir / name
        if f.exists():
            f.unlink()
            changed = True
    return changed


def checkpoint_bytes(ckpt_dir: Path) -> int:
    """Bytes of the files in a checkpoint directory (0 if it does not exist)."""
    d = Path(ckpt_dir)
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) if d.is_dir() else 0
