"""MLflow: one run per training run (params, per-iteration metrics, sample grids, resolved
config) and the model registry: one registered model per experiment (`<experiment>-policy`),
one version per published checkpoint of any of its runs, tagged with run and iteration; aliases
`rollout` (the experiment's latest published version) and `champion` (its best held-out
evaluation, compared through each evaluated version's `heldout_accuracy` tag).

Everything goes through an explicit run id (MlflowClient), never the global "active run", so
tasks running in any process log into the right run.

A checkpoint is stored once. `publish` registers the checkpoint directory itself as the version's
source (a file: URI in the checkpoint store, outside MLflow's artifact root): nothing is copied into
`mlruns/`, and `models:/NAME/V` resolves to the checkpoint directory through MLflow's own
download path. MLflow accepts such a source when the registry is reached directly (sqlite, a
database URI); an MLflow *server* (http URI) refuses local sources outside the run's artifact
directory, and there `publish` falls back to logging a copy into the run's artifacts (the old
behaviour), with a warning and the version tag `pixrl.storage=mlflow-artifacts`.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import mlflow
import numpy as np
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from .checkpoints import OPTIMIZER, RNG, CheckpointPruned
from .mlflow_store import init_store_once

log = logging.getLogger(__name__)

ROLLOUT_ALIAS = "rollout"
CHAMPION_ALIAS = "champion"  # best held-out evaluation so far
HELDOUT_TAG = "heldout_accuracy"


def policy_model_name(experiment: str) -> str:
    """The registered model of an experiment: its runs' versions side by side, one alias set."""
    return f"{experiment}-policy"


@dataclass(frozen=True)
class PolicyRef:
    """An exact published policy: registry name + version (0 = the base weights, nothing loaded)."""

    model_name: str
    version: int
    source: str | None = None  # URI of the checkpoint directory (file:// in the checkpoint store)
    checkpoint_id: str | None = None

    def to_dict(self) -> dict:
        return self.__dict__.copy()


PRUNED_TAG = "pixrl.pruned"  # set on a registered version whose weights retention deleted
WEIGHTS_ONLY_TAG = "pixrl.weights_only"  # set on a version whose optimizer/RNG state retention deleted
STORAGE_TAG = "pixrl.storage"  # where the version's files are: checkpoint-store | mlflow-artifacts


class PrunedCheckpoint(CheckpointPruned):
    """A registered policy version whose weights (or, for `check_trainable`, optimizer state)
    retention (`run.retention`) deleted. `except CheckpointPruned` catches this and the
    checkpoint-level error of `checkpoints.require_full_checkpoint` alike."""


def local_path(uri: str | None) -> Path | None:
    """The filesystem path of a file: URI or plain path; None for any other scheme."""
    if not uri:
        return None
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "file":
        return Path(urllib.parse.unquote(parsed.path))
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):
        return Path(uri)
    return None


class Tracker:
    def __init__(self, tracking_uri: str):
        self.uri = tracking_uri
        init_store_once(tracking_uri)
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        self._registered: set[str] = set()  # registered models known to exist (pixrl never deletes one)

    def artifact_root(self) -> str | None:
        """<dir of the sqlite file>/mlruns for a local sqlite store, so artifacts (checkpoints!) live
        beside the database in the work directory, not in whatever directory the process ran from."""
        if self.uri.startswith("sqlite:///"):
            return str(Path(self.uri[len("sqlite:///"):]).resolve().parent / "mlruns")
        return None

    def start_run(self, experiment: str, run_name: str, tags: dict[str, str]) -> str:
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            root = self.artifact_root()
            exp_id = self.client.create_experiment(experiment, artifact_location=f"{root}/{experiment}" if root else None)
        else:
            exp_id = exp.experiment_id
        run = self.client.create_run(exp_id, run_name=run_name, tags=tags)
        return run.info.run_id

    def find_run(self, tag: str, value: str) -> str | None:
        """Newest run with tags.<tag> = value, in any experiment."""
        exps = [e.experiment_id for e in self.client.search_experiments()]
        runs = self.client.search_runs(exps, filter_string=f"tags.`{tag}` = '{value}'",
                                       order_by=["attributes.start_time DESC"], max_results=1) if exps else []
        return runs[0].info.run_id if runs else None

    def reopen(self, run_id: str, tags: dict[str, str]) -> None:
        self.client.update_run(run_id, status="RUNNING")
        self.set_tags(run_id, tags)

    def read_config(self, run_id: str) -> dict:
        import yaml

        with tempfile.TemporaryDirectory() as d:
            path = self.client.download_artifacts(run_id, "config/resolved.yaml", d)
            return yaml.safe_load(Path(path).read_text())

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i:i + 100])

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int) -> None:
        import time

        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step) for k, v in metrics.items()]
        for i in range(0, len(items), 500):
            self.client.log_batch(run_id, metrics=items[i:i + 500])

    def log_missing_metrics(self, run_id: str, metrics: dict[str, float], step: int) -> list[str]:
        """Log only the metrics that have no value at this step yet (crash recovery); returns them."""
        missing = {k: v for k, v in metrics.items()
                   if all(m.step != step for m in self.client.get_metric_history(run_id, k))}
        if missing:
            self.log_metrics(run_id, missing, step)
        return sorted(missing)

    def log_dict(self, run_id: str, obj: dict, artifact_file: str) -> None:
        self.client.log_dict(run_id, obj, artifact_file)

    def log_image(self, run_id: str, image: np.ndarray, key: str, step: int) -> None:
        self.client.log_image(run_id, image, key=key, step=step)

    def log_file_bytes(self, run_id: str, data: bytes, artifact_file: str) -> None:
        """Encoded bytes (a PNG, a WAV) at a fixed artifact path (what Prefect artifacts and docs link to)."""
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / Path(artifact_file).name
            path.write_bytes(data)
            self.client.log_artifact(run_id, str(path), str(Path(artifact_file).parent) or None)

    def log_folder_bytes(self, run_id: str, files: dict[str, bytes], artifact_dir: str) -> None:
        """Named encoded files (WAVs, …) in one artifact folder, logged in one call."""
        with tempfile.TemporaryDirectory() as d:
            for name, data in files.items():
                (Path(d) / name).write_bytes(data)
            self.client.log_artifacts(run_id, d, artifact_dir)

    def artifact_uri(self, run_id: str, path: str = "") -> str:
        base = self.client.get_run(run_id).info.artifact_uri
        return f"{base}/{path}" if path else base

    def get_metric_history(self, run_id: str, key: str) -> list[float]:
        return [m.value for m in sorted(self.client.get_metric_history(run_id, key), key=lambda m: m.step)]

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    # --- registry -----------------------------------------------------------------------------
    def publish(self, run_id: str, ckpt_dir: Path, iteration: int, model_name: str,
                checkpoint_id: str, tags: dict[str, str], before_alias=None) -> PolicyRef:
        """Register the checkpoint directory as a new version (its source: the directory's file URI,
        no copy), then move alias `rollout`. The directory must stay where it is: it is the version."""
        self._ensure_registered(model_name)
        vtags = {"checkpoint_id": checkpoint_id, "iteration": str(iteration), **tags}
        source = Path(ckpt_dir).resolve().as_uri()
        try:
            mv = self.client.create_model_version(model_name, source=source, run_id=run_id,
                                                  tags={**vtags, STORAGE_TAG: "checkpoint-store"})
        except MlflowException as exc:
            if "local path as a model version source" not in str(exc):
                raise
            # an MLflow server accepts local sources only inside the run's artifact directory
            log.warning("the MLflow server at %s refuses %s as a model version source (%s); logging a copy of the "
                        "checkpoint into the run's artifacts instead", self.uri, source, exc)
            artifact_path = f"checkpoints/{Path(ckpt_dir).name}"
            self.client.log_artifacts(run_id, str(ckpt_dir), artifact_path)
            source = f"{self.client.get_run(run_id).info.artifact_uri}/{artifact_path}"
            mv = self.client.create_model_version(model_name, source=source, run_id=run_id,
                                                  tags={**vtags, STORAGE_TAG: "mlflow-artifacts"})
        if before_alias is not None:
            before_alias()
        self.client.set_registered_model_alias(model_name, ROLLOUT_ALIAS, mv.version)
        return PolicyRef(model_name, int(mv.version), source, checkpoint_id)

    def _ensure_registered(self, model_name: str) -> None:
        if model_name in self._registered:
            return
        try:
            self.client.get_registered_model(model_name)
        except MlflowException:
            try:
                self.client.create_registered_model(model_name, tags={"pixrl": "policy"})
            except MlflowException as exc:  # another run of the experiment created it meanwhile
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
        self._registered.add(model_name)

    def run_versions(self, model_name: str, run_id: str) -> list:
        """Every version one run registered (searched by run id, not the whole model's history)."""
        try:
            return self.client.search_model_versions(f"name='{model_name}' and run_id='{run_id}'")
        except MlflowException:
            return []

    def find_version(self, model_name: str, run_id: str, iteration: int) -> PolicyRef | None:
        """The version this run registered for this iteration, if any. The registry filters on the
        iteration tag, so the cost does not grow with the run's number of versions (fetching all
        of them took 68–205 ms at 300 versions against 36 ms filtered)."""
        try:
            found = self.client.search_model_versions(
                f"name='{model_name}' and run_id='{run_id}' and tags.iteration='{int(iteration)}'")
        except MlflowException:
            return None
        return _ref(min(found, key=lambda mv: int(mv.version))) if found else None

    def latest_of_run(self, model_name: str, run_id: str) -> PolicyRef | None:
        """A run's newest published version (its own 'rollout', whatever other runs published since)."""
        versions = self.run_versions(model_name, run_id)
        return _ref(max(versions, key=lambda mv: int(mv.version))) if versions else None

    def champion_of_run(self, model_name: str, run_id: str) -> PolicyRef | None:
        """A run's best evaluated version (earliest among equals), from the `heldout_accuracy` tags."""
        scored = [mv for mv in self.run_versions(model_name, run_id) if HELDOUT_TAG in mv.tags]
        if not scored:
            return None
        return _ref(max(scored, key=lambda mv: (float(mv.tags[HELDOUT_TAG]), -int(mv.version))))

    def record_evaluation(self, policy: PolicyRef, accuracy: float, n: int) -> bool:
        """Tag the version with its held-out accuracy, then move the experiment's `champion` alias to
        it if it beats the current champion (strictly). Returns whether the alias moved."""
        name, version = policy.model_name, str(policy.version)
        self.client.set_model_version_tag(name, version, HELDOUT_TAG, repr(float(accuracy)))
        self.client.set_model_version_tag(name, version, "heldout_n", str(int(n)))
        try:
            current = self.client.get_model_version_by_alias(name, CHAMPION_ALIAS)
        except MlflowException:
            current = None
        if current is not None and current.version != version and HELDOUT_TAG in current.tags \
                and float(current.tags[HELDOUT_TAG]) >= accuracy:
            return False
        self.client.set_registered_model_alias(name, CHAMPION_ALIAS, version)
        return True

    def move_alias(self, policy: PolicyRef, alias: str = ROLLOUT_ALIAS) -> None:
        self.client.set_registered_model_alias(policy.model_name, alias, str(policy.version))

    def version(self, model_name: str, version: int) -> PolicyRef:
        return _ref(self.client.get_model_version(model_name, str(version)))

    def check_loadable(self, policy: PolicyRef) -> None:
        """Raise PrunedCheckpoint, naming the way out, if retention deleted this version's weights
        (or its checkpoint directory is gone). A weights-only version is loadable."""
        if policy.version == 0:
            return
        mv = self.client.get_model_version(policy.model_name, str(policy.version))
        where = f"models:/{policy.model_name}/{policy.version} (run {mv.run_id}, iteration {mv.tags.get('iteration')})"
        if mv.tags.get(PRUNED_TAG):
            raise PrunedCheckpoint(
                f"{where} was pruned by {mv.tags[PRUNED_TAG]}: its weights are deleted. Use a kept version (the "
                f"run's newest, an evaluated one, or an aliased one), and set run.retention.keep_full higher (or "
                f"null) or lower run.retention.weights_every to keep more.")
        path = local_path(mv.source)
        if path is not None and not path.is_dir():
            raise PrunedCheckpoint(f"{where}: its checkpoint directory {path} does not exist (deleted or moved "
                                   f"outside pixrl); the version cannot be loaded")

    def check_trainable(self, policy: PolicyRef, purpose: str) -> None:
        """Raise PrunedCheckpoint unless training can continue from `policy`: its weights and its
        optimizer state are kept (a weights-only version cannot be). A registry-only check, for
        before any work starts (a fork, a replay); `purpose` names what needs it."""
        self.check_loadable(policy)
        if policy.version == 0:
            return
        mv = self.client.get_model_version(policy.model_name, str(policy.version))
        if mv.tags.get(WEIGHTS_ONLY_TAG):
            raise PrunedCheckpoint(
                f"checkpoint it_{int(mv.tags.get('iteration', -1)):04d}'s optimizer state ({OPTIMIZER}) and RNG "
                f"state ({RNG}) were pruned by retention ({mv.tags[WEIGHTS_ONLY_TAG]}); {purpose} needs them. "
                f"models:/{policy.model_name}/{policy.version} (run {mv.run_id}) keeps its weights only. Keep more "
                f"checkpoints whole with run.retention.keep_full (null: keep all).")

    def download(self, policy: PolicyRef, dst: Path) -> Path:
        """The version's checkpoint directory, materialised under `dst` (returns the directory
        holding the files). A checkpoint in a local store is hard-linked file by file (no bytes
        copied; its files are never modified in place), falling back to a copy across filesystems;
        any other source goes through MLflow's download."""
        self.check_loadable(policy)
        dst.mkdir(parents=True, exist_ok=True)
        src = local_path(policy.source)
        if src is not None and src.is_dir():
            return _link_tree(src, dst / src.name)
        mlflow.set_tracking_uri(self.uri)
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=policy.source, dst_path=str(dst)))


def _link_tree(src: Path, out: Path) -> Path:
    """Hard-link (or copy, where linking fails) every file of `src` into `out`, replacing files there;
    the manifest last, so a checkpoint stripped meanwhile yields the manifest of what was linked."""
    for f in sorted(src.rglob("*"), key=lambda f: (f.name == "manifest.json", str(f))):
        if not f.is_file():
            continue
        target = out / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            target.unlink()
        try:
            os.link(f, target)
        except OSError:
            shutil.copy2(f, target)
    return out


def _ref(mv) -> PolicyRef:
    return PolicyRef(mv.name, int(mv.version), mv.source, mv.tags.get("checkpoint_id"))


def default_tracking_uri(workdir: Path) -> str:
    return f"sqlite:///{(workdir / 'mlflow.db').resolve()}"

