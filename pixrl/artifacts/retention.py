"""Checkpoint retention (`run.retention`): a run writes one checkpoint per iteration — weights,
optimizer state (twice the weights for AdamW), RNG state — which fills a disk in a few hundred
iterations. A checkpoint is stored once (its registered version's source is the checkpoint
directory, see tracking.py), so retention acts on that one copy.

The ladder, decided per registered version of the run:

- **full** — the newest `keep_full` (by iteration): resume continues from the newest, and replay
  or a fork of the last iterations' update needs the previous checkpoint's optimizer state.
  Also every aliased version (`rollout`, `champion`, any other alias: someone points at it) and,
  with `keep_evaluated`, every evaluated one (tag `heldout_accuracy`: the held-out curve's points).
- **weights-only** — an older version whose iteration+1 is a multiple of `weights_every` (the
  weights after N, 2N, … updates, the points `run.eval_every=N` evaluates): optimizer and RNG state
  are deleted, the manifest rewritten (`checkpoints.strip_to_weights`) and the version tagged
  `pixrl.weights_only`. It still loads for generation, evaluation, `pixrl eval`, DPO init/reference;
  continuing training from it fails naming what is missing (`require_full_checkpoint`).
- **pruned** — every other version: the directory is deleted and the version tagged `pixrl.pruned`.
  It stays registered with its run, iteration and checkpoint id, so lineage from Lance rows
  (policy_version) still resolves; loading it fails with a message (Tracker.check_loadable).

`apply_retention` is a pure function of the registry (versions, their tags, the aliases) and the
checkpoint store: running it again changes nothing, and a crash in the middle is finished by the
next call, because every step is idempotent and ordered tag first, files after (a version is
never without its files and without the tag that says why). Nothing is ever restored: a version
that becomes aliased or evaluated after it was reduced stays as it is. Versions registered before
checkpoints were stored once (a copy under mlruns/ plus the local directory) are handled too: the
same action applies to both copies.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..config.schema import RetentionConfig
from .checkpoints import TRAINING_STATE, CorruptCheckpoint, checkpoint_bytes, read_counters, strip_to_weights
from .tracking import HELDOUT_TAG, PRUNED_TAG, WEIGHTS_ONLY_TAG, Tracker, local_path

log = logging.getLogger(__name__)

FULL, WEIGHTS_ONLY, PRUNED = "full", "weights_only", "pruned"


def describe(policy: RetentionConfig) -> str:
    """The policy as the tags and error messages quote it, e.g. 'keep_full=3, weights_every=10'."""
    text = f"keep_full={policy.keep_full}, weights_every={policy.weights_every}"
    return text if policy.keep_evaluated else text + ", keep_evaluated=False"


@dataclass(frozen=True)
class VersionInfo:
    """What the ladder looks at of one registered version."""

    version: int
    iteration: int
    evaluated: bool
    aliased: bool


def classify(versions: list[VersionInfo], policy: RetentionConfig) -> dict[int, str]:
    """version → FULL | WEIGHTS_ONLY | PRUNED for one run's versions (pure; no I/O)."""
    if policy.keep_full is None:
        return {v.version: FULL for v in versions}
    ordered = sorted(versions, key=lambda v: (v.iteration, v.version))
    newest = {v.version for v in ordered[-policy.keep_full:]}
    out = {}
    for v in ordered:
        if v.version in newest or v.aliased or (v.evaluated and policy.keep_evaluated):
            out[v.version] = FULL
        elif policy.weights_every and (v.iteration + 1) % policy.weights_every == 0:
            out[v.version] = WEIGHTS_ONLY
        else:
            out[v.version] = PRUNED
    return out


@dataclass
class RetentionResult:
    """What one call changed (empty when the store already matched the policy)."""

    plan: dict[int, str] = field(default_factory=dict)  # iteration → FULL | WEIGHTS_ONLY | PRUNED
    weights_only: list[int] = field(default_factory=list)  # iterations reduced to their weights now
    pruned: list[int] = field(default_factory=list)  # iterations whose checkpoint was deleted now
    bytes_freed: int = 0

    def metrics(self) -> dict[str, float]:
        return {"checkpoints_pruned": float(len(self.pruned)),
                "checkpoints_weights_only": float(len(self.weights_only)),
                "checkpoint_bytes_freed": float(self.bytes_freed)}


def _version_dirs(mv, local_root: Path | None) -> list[Path]:
    """The local directories holding a version's files: its source, and (versions registered with a
    copy under mlruns/) the run's local checkpoint of that iteration, if it is the same checkpoint."""
    dirs = []
    src = local_path(mv.source)
    if src is not None:
        dirs.append(src)
    if local_root is not None:
        d = Path(local_root) / f"it_{int(mv.tags['iteration']):04d}"
        if d.is_dir() and all(d.resolve() != x.resolve() for x in dirs):
            try:
                same = read_counters(d).get("checkpoint_id") == mv.tags.get("checkpoint_id")
            except (OSError, ValueError):
                same = False
            if same:
                dirs.append(d)
    return dirs


class RunRetention:
    """Retention of one run across its publishes, in the process that holds the run's lock.

    The first `apply()` walks every version the run registered (one registry search: 73 ms at 300
    versions). A version's state is then *settled* when no later publish can change it under the
    same policy — pruned, reduced to weights-only, or kept whole as an evaluated version — and
    later calls fetch only the unsettled versions (the newest `keep_full`, the aliased ones) and
    the newly published one, so a publish costs the same at iteration 300 as at iteration 3. The
    run lock makes this process the run's only publisher; another process starts with a full walk."""

    def __init__(self, tracker: Tracker, model_name: str, run_id: str, policy: RetentionConfig,
                 local_root: Path | None = None):
        self.tracker, self.model_name, self.run_id = tracker, model_name, run_id
        self.policy, self.local_root = policy, local_root
        self._settled: dict[int, VersionInfo] = {}  # version → what classify needs (it never changes)
        self._open: set[int] | None = None  # unsettled versions; None before the first (full) walk
        self._new: set[int] = set()  # published since the last walk

    def published(self, version: int) -> None:
        """Note a version this run registered (the next `apply` looks at it)."""
        self._new.add(int(version))

    def _fetch(self) -> tuple[list, set[str]]:
        """(the versions to look at, the aliased version numbers among them)."""
        if self._open is None:
            versions = [mv for mv in self.tracker.run_versions(self.model_name, self.run_id) if "iteration" in mv.tags]
            if not versions:
                return [], set()
            aliases = self.tracker.client.get_registered_model(self.model_name).aliases
            return versions, {str(v) for v in aliases.values()}
        wanted = sorted(self._open | self._new)
        versions = [mv for mv in (self.tracker.client.get_model_version(self.model_name, str(v)) for v in wanted)
                    if "iteration" in mv.tags]
        return versions, {str(mv.version) for mv in versions if mv.aliases}

    def apply(self) -> RetentionResult:
        """Bring the run's checkpoints in line with the policy (see the module docstring)."""
        try:
            return self._apply()
        except BaseException:
            self._open = None  # whatever was half-done, the next call walks everything again
            raise

    def _apply(self) -> RetentionResult:
        """The result's plan covers the versions looked at (all of them on a full walk)."""
        versions, aliased = self._fetch()
        infos = [VersionInfo(int(mv.version), int(mv.tags["iteration"]), HELDOUT_TAG in mv.tags,
                             str(mv.version) in aliased) for mv in versions]
        plan = classify(list(self._settled.values()) + infos, self.policy)
        res = RetentionResult()
        for mv, info in sorted(zip(versions, infos), key=lambda x: x[1].iteration):
            action = plan[info.version]
            res.plan[info.iteration] = action
            _act(self.tracker, self.model_name, mv, action, describe(self.policy),
                 _version_dirs(mv, self.local_root) if action != FULL else [], res)
        self._open, self._new = set(), set()
        for info in infos:
            action = plan[info.version]
            if action != FULL or (info.evaluated and self.policy.keep_evaluated) or self.policy.keep_full is None:
                self._settled[info.version] = info
            else:
                self._open.add(info.version)
        return res


def _act(tracker: Tracker, model_name: str, mv, action: str, reason: str, dirs: list[Path],
         res: RetentionResult) -> None:
    """Carry out one version's action: tag first, files after (idempotent; nothing is restored)."""
    it = int(mv.tags["iteration"])
    if action == FULL or (action == WEIGHTS_ONLY and mv.tags.get(PRUNED_TAG)):
        return  # a pruned version stays pruned
    if action == WEIGHTS_ONLY:
        if not mv.tags.get(WEIGHTS_ONLY_TAG):
            tracker.client.set_model_version_tag(model_name, mv.version, WEIGHTS_ONLY_TAG, reason)
        for d in dirs:
            if mv.tags.get(WEIGHTS_ONLY_TAG) and not any((d / f).exists() for f in TRAINING_STATE):
                continue  # reduced by an earlier pass: no re-verification at every publish
            if d.is_dir():
                before = checkpoint_bytes(d)
                try:
                    changed = strip_to_weights(d, reason)
                except CorruptCheckpoint as exc:  # left as found (it will not load); publishing goes on
                    log.warning("retention leaves %s alone: %s", d, exc)
                    continue
                if changed:
                    res.bytes_freed += before - checkpoint_bytes(d)
                    if it not in res.weights_only:
                        res.weights_only.append(it)
        return
    if not mv.tags.get(PRUNED_TAG):
        tracker.client.set_model_version_tag(model_name, mv.version, PRUNED_TAG, f"retention ({reason})")
    for d in dirs:
        if d.exists():
            res.bytes_freed += checkpoint_bytes(d)
            shutil.rmtree(d)
            if it not in res.pruned:
                res.pruned.append(it)
    if local_path(mv.source) is None and _delete_remote(mv.source) and it not in res.pruned:
        res.pruned.append(it)


def apply_retention(tracker: Tracker, model_name: str, run_id: str, policy: RetentionConfig,
                    local_root: Path | None = None) -> RetentionResult:
    """Bring one run's checkpoints in line with `policy` with a full walk of its versions
    (see the module docstring); idempotent. `local_root` (<workdir>/checkpoints/<run>/<run_id>) is
    needed only for versions registered with a second copy under mlruns/ (before checkpoints were
    stored once). A run's own publishes use `RunRetention`, which walks only what can change."""
    return RunRetention(tracker, model_name, run_id, policy, local_root).apply()


def _delete_remote(source: str) -> bool:
    """Delete a version's artifacts in a remote artifact store (versions copied into MLflow's
    artifacts); returns whether there was anything to delete."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    repo = get_artifact_repository(source)
    if not repo.list_artifacts():
        return False
    repo.delete_artifacts()
    return True


def prune_checkpoints(tracker: Tracker, model_name: str, run_id: str, local_root: Path,
                      keep: RetentionConfig | int | None) -> list[int]:
    """Apply retention to one run; returns the iterations whose checkpoints were deleted now.

    `keep` is the run's RetentionConfig (`cfg.run.retention`), or — the deprecated form — the
    number of newest checkpoints kept whole (run.keep_checkpoints), with the other settings at
    their defaults. Use `apply_retention` for the full result (weights-only reductions, bytes)."""
    if isinstance(keep, RetentionConfig):
        policy = keep
    elif keep is None:
        policy = RetentionConfig(keep_full=None)
    elif keep < 1:
        raise ValueError(f"keep_checkpoints must be ≥ 1 (the newest checkpoint resumes the run), got {keep}")
    else:
        policy = RetentionConfig(keep_full=keep)
    return sorted(apply_retention(tracker, model_name, run_id, policy, local_root).pruned)
