"""Keeping the trajectory table's stage cost and size flat over a long run (issue 14).

What the engine calls, once per iteration after the iteration's last column write (replay):

    maintain_store(store, iteration)   # does its work every `every` (10) iterations

    maintain_store(store: TrajectoryStore, iteration: int | None = None, *, every: int = 10,
                   index: str | None = "BITMAP", keep_versions: int = 8,
                   older_than: timedelta = timedelta(minutes=10), cleanup: bool = True,
                   delete_unverified: bool = False) -> MaintenanceReport | None

It makes at most one commit (the index update; never a stage's), then deletes old versions.
It is safe to skip or to run late: reads stay correct, only the fragments the index does not
cover are scanned. A consumer that records `uri@version` and reads it later while the owning
run goes on (a DPO source, a fork's parent version) keeps it with `pin_version` (a tag).

Measured with `benchmarks/store_history.py` (the store's side of every stage, as the local
engine calls it; 128 rows per iteration, latents 4×[4,8,8] f32 ×2, final latent, ~1 KB PNGs:
1.376 MB of Arrow payload per iteration). Store seconds per stage (checks + read + write),
median over iterations 1–20 → median over the last 20; 2 cores shared with other test runs
(load 8–11), so single figures move by ±30%:

| store                                   | its | decode          | score           | replay          | on disk / iteration            |
|-----------------------------------------|-----|-----------------|-----------------|-----------------|--------------------------------|
| merge_insert, no maintenance (before)   | 120 | 0.094 → 0.613   | 0.090 → 0.582   | 0.098 → 0.709   | 5.27 MB = 3.83× (480 versions) |
| column files + BITMAP, every 10         | 120 | 0.037 → 0.036   | 0.043 → 0.037   | 0.039 → 0.035   | 1.37 MB = 1.00×                |
| column files, no index (cleanup only)   | 300 | 0.051 → 0.409   | 0.049 → 0.401   | 0.049 → 0.436   | 1.41 MB = 1.02×                |
| column files + BTREE, every 10          | 300 | 0.032 → 0.065   | 0.031 → 0.065   | 0.033 → 0.062   | 1.42 MB = 1.03× (index 3.0 MB) |
| column files + BITMAP, every 1          | 300 | 0.037 → 0.047   | 0.040 → 0.055   | 0.042 → 0.055   | 1.45 MB = 1.06× (index 13.5 MB)|
| column files + BITMAP, every 10: chosen | 300 | 0.032 → 0.060   | 0.031 → 0.061   | 0.028 → 0.061   | 1.41 MB = 1.03× (index 1.4 MB) |

The chosen store at 300 iterations on a less loaded machine: 0.028 → 0.046, 0.028 → 0.044,
0.028 → 0.050. Bytes added per iteration over the last 20 iterations: 1.07× the payload.
(The issue measured 0.7/0.4/0.2 s → 1.7/1.4/1.2 s for the whole stages at iteration 300, and
623 MB / 480 versions after 120 iterations; the benchmark's merge_insert store reproduces
632 MB / 480 versions.) Maintenance costs 0.004 s per iteration early and 0.13 s per iteration
(1.3 s every 10) at 300, mostly `cleanup_old_versions` reading every kept manifest; every 1
cost 0.9 s per iteration at 300.

Why this design:
- column files instead of merge_insert: merge_insert deletes the matched rows and writes
  them whole into new fragments, so each iteration's latents are written 4 times; the tag on
  every generate version keeps generate's copy alive, so with this module's cleanup it still
  took 2.30× the payload (12 iterations of 32 rows; the column files: 1.08×). `update_columns` writes 128 KB of
  PNGs, a few KB of rewards and advantages, nothing else.
- an index on `iteration`: without it every check, read and write scans (run_id, iteration)
  of all fragments, 0.05 → 0.41 s by iteration 300. BITMAP (one bitmap per iteration) and
  BTREE answer equally fast; BITMAP is half the bytes.
- every 10 rather than every iteration: each index rewrite is referenced by the next generate
  tag, so it is never deleted: every 1 keeps 300 copies (13.5 MB), every 10 keeps 30 (1.4 MB);
  the ≤ 10 fragments appended since are scanned (a few ms), and cleanup's cost is spread.
- no compaction: it rewrites data files that the generate tags still reference, so it adds
  bytes instead of freeing them (compact_files + cleanup on the 300-iteration table: 441 →
  844 MB), and it would put several iterations in one fragment, so a column write would
  rewrite other iterations' columns. Each iteration stays one fragment.
- what still grows: every version's manifest lists every fragment with its 4 data files
  (~0.42 KB per iteration). Opening the latest version and committing cost ~0.1 ms more per
  past iteration (merge_insert: ~5 ms more per past iteration), and the kept (tagged) manifests
  hold Σ 0.42 KB·k: 19.5 MB at 300 iterations. The bytes added per iteration reach 1.3× the
  payload around iteration 950 and the average around 1,900; a longer run should drop old
  generate tags (keep every 10th, say) or start a new table.
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
