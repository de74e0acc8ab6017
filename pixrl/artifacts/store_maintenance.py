"""Keeping the trajectory table's stage cost and size flat over a long run (issue 14).

FIGURES

What the engine calls, once per iteration after its last column write (replay), or every N
iterations:

    maintain_store(store, *, index="BITMAP", keep_versions=8, older_than=timedelta(minutes=10),
                   cleanup=True, delete_unverified=False) -> MaintenanceReport

It makes at most one commit (the index update), never a stage's, and is safe to skip: reads
stay correct without it, only slower (the fragments the index does not cover are scanned).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

from .trajectories import TrajectoryStore

INDEX_NAME = "iteration_idx"
INDEX_COLUMN = "iteration"


@dataclass(frozen=True)
class MaintenanceReport:
    version_before: int | None
    version_after: int | None
    index: str  # "created", "updated", "current", "off"
    versions_removed: int = 0
    bytes_removed: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def pin_version(store: TrajectoryStore, version: int, name: str) -> str:
    """Keep `version` readable through every cleanup: tag it `pin-<name>`. For a consumer that
    records `uri@version` and reads it later (a DPO source, a fork's parent version) while the
    run that owns the table goes on writing and cleaning. Returns the tag."""
    tag = f"pin-{name}"
    store.tag(tag, int(version))
    return tag


def update_index(store: TrajectoryStore, index: str = "BITMAP") -> str:
    """Create the scalar index on `iteration`, or fold the fragments appended since into it.
    One commit when there is something to do, none otherwise."""
    ds = store.dataset()
    if INDEX_NAME not in {i.name for i in ds.describe_indices()}:
        ds.create_scalar_index(INDEX_COLUMN, index, name=INDEX_NAME)
        return "created"
    if not ds.stats.index_stats(INDEX_NAME).get("num_unindexed_fragments"):
        return "current"
    ds.optimize.optimize_indices(index_names=[INDEX_NAME])
    return "updated"


def maintain_store(store: TrajectoryStore, iteration: int | None = None, *, every: int = 10,
                   index: str | None = "BITMAP", keep_versions: int = 8,
                   older_than: timedelta = timedelta(minutes=10), cleanup: bool = True,
                   delete_unverified: bool = False) -> MaintenanceReport | None:
    """Bring the `iteration` index up to date, then delete old versions.

    Kept: every tagged version (the engine tags each iteration's generate version
    `<run>-it<N>-generate`; a tag is also how a consumer pins a version for good), the newest
    `keep_versions` versions (the current iteration's stage references), every version younger
    than `older_than` (references a concurrent reader may still hold), and every file one of
    those versions reads. Removed: the manifests and transaction files of the other versions
    and the data and index files only they referenced. `delete_unverified` also deletes files
    of failed or in-flight commits younger than 7 days: only when no other process writes the
    table."""
    if keep_versions < 1 or every < 1:
        raise ValueError(f"keep_versions and every must be ≥ 1, got {keep_versions} and {every}")
    if iteration is not None and (iteration + 1) % every:
        return None
    t0 = time.perf_counter()
    if not store.exists():
        return MaintenanceReport(None, None, "off" if not index else "current")
    before = store.latest_version()
    done = update_index(store, index) if index else "off"
    removed = nbytes = 0
    if cleanup:
        stats = store.dataset().cleanup_old_versions(
            older_than=older_than, retain_versions=keep_versions, delete_unverified=delete_unverified,
            error_if_tagged_old_versions=False)
        removed, nbytes = stats.old_versions, stats.bytes_removed
    return MaintenanceReport(before, store.latest_version(), done, removed, nbytes, time.perf_counter() - t0)
