"""Checkpoint retention (`run.keep_checkpoints`): a long run writes one full checkpoint per
iteration, locally and into the registry, which fills a disk in a few hundred iterations.

Pruning keeps a run's newest N checkpoints. Older ones lose their local directory and their
registry artifacts. A version that was evaluated (it carries `heldout_accuracy`) or holds an
alias keeps its registry copy, so the held-out curve's points and the champion stay loadable.
A pruned version stays registered with its run, iteration and checkpoint id, and the tag
`pixrl.pruned`, so lineage from Lance rows (policy_version) still resolves to where it came
from; loading it fails with a message instead of a missing-file error.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

from .tracking import PRUNED_TAG, Tracker


def _keeps_registry_copy(mv, aliased: set[str]) -> bool:
    return "heldout_accuracy" in mv.tags or str(mv.version) in aliased


def prune_checkpoints(tracker: Tracker, model_name: str, run_id: str, local_root: Path, keep: int) -> list[int]:
    """Apply retention to one run; returns the iterations whose checkpoints were deleted now.

    Idempotent (a crash between steps is finished by the next call): the tag is written before
    the artifacts are deleted, so a version is never without weights and without the tag."""
    if keep < 1:
        raise ValueError(f"keep_checkpoints must be ≥ 1 (the newest checkpoint resumes the run), got {keep}")
    versions = sorted(tracker.run_versions(model_name, run_id), key=lambda mv: int(mv.tags.get("iteration", -1)))
    aliased = {str(v) for v in tracker.client.get_registered_model(model_name).aliases.values()} if versions else set()
    pruned = []
    for mv in versions[:-keep]:
        it = int(mv.tags["iteration"])
        local = Path(local_root) / f"it_{it:04d}"
        if local.exists():
            shutil.rmtree(local)
            pruned.append(it)
        if _keeps_registry_copy(mv, aliased) or mv.tags.get(PRUNED_TAG):
            continue
        tracker.client.set_model_version_tag(model_name, mv.version, PRUNED_TAG, f"keep_checkpoints={keep}")
        get_artifact_repository(mv.source).delete_artifacts()
        if it not in pruned:
            pruned.append(it)
    return sorted(pruned)
