"""The algorithm's stored policies (`Algorithm.stored_policies`: DiffusionOPD's teacher) as the
stage layer sees them, checked when a run opens and resolved to local directories the engine
loads: a registered version `models:/NAME/VERSION` (it exists, its weights are loadable, it was
trained as this run trains; a version is immutable, so a resumed or replayed update distils from
the same teacher), or a diffusers directory of the run's model architecture."""

from __future__ import annotations

from pathlib import Path

from mlflow.exceptions import MlflowException

from ..artifacts.tracking import PolicyRef, Tracker, local_path
from ..engines.assets import resolve_model_path
from ..engines.base import PolicySource
from ..engines.stored_policies import check_same_architecture, check_trained_alike, component_dir
from ..errors import ExpectedError


class StoredPolicyError(ExpectedError, ValueError):
    pass


def parse_model_uri(uri: str, what: str) -> tuple[str, int]:
    """(registered model name, version) of models:/NAME/VERSION."""
    name, _, version = uri[len("models:/"):].partition("/")
    if not uri.startswith("models:/") or not name or not version.isdigit() or int(version) < 1:
        raise StoredPolicyError(f"{what}={uri!r}: expected models:/NAME/VERSION (a registered policy version, e.g. "
                                f"models:/shapes-policy/12 — `pixrl status` lists a run's versions)")
    return name, int(version)


def registered_version(tracker: Tracker, uri: str, what: str) -> PolicyRef:
    """The registered version `uri` names, or a StoredPolicyError naming what exists."""
    name, version = parse_model_uri(uri, what)
    try:
        return tracker.version(name, version)
    except MlflowException:
        try:
            have = sorted(int(v.version) for v in tracker.client.search_model_versions(f"name='{name}'"))
        except MlflowException:
            have = []
        known = f"its versions: {have}" if have else f"no registered model {name!r}"
        raise StoredPolicyError(f"{what}={uri}: no such version in {tracker.uri} ({known}); name a registered "
                                f"version of this tracking store") from None


def _directory(uri: str, cfg, what: str) -> Path:
    """A directory teacher: it exists, and its trained component is the run's model architecture."""
    from ..models.registry import get_family

    path = Path(uri).expanduser().resolve()
    component = get_family(cfg.model.family).trained_component(cfg.model.family_options())
    try:
        theirs = component_dir(path, component)
        check_same_architecture(theirs, component_dir(resolve_model_path(cfg.model.path), component), f"{what}={uri}")
    except (FileNotFoundError, ValueError) as exc:
        raise StoredPolicyError(f"{what}={uri}: {exc}" if isinstance(exc, FileNotFoundError) else str(exc)) from None
    if cfg.run.engine == "ray" and cfg.ray.trainer_sharding == "fsdp":
        raise StoredPolicyError(f"{what}={uri}: a diffusers directory is loaded as a whole module of its own, which a "
                                f"sharded (FSDP) trainer does not hold; set ray.trainer_sharding=none, or name a "
                                f"registered version (models:/NAME/VERSION) trained with this run's settings")
    return path


def check_stored_policies(algorithm, cfg, tracker: Tracker) -> None:
    """Before a run writes anything: every stored policy names a loadable version trained alike
    (its checkpoint is checked here when it is a local directory, else when the engine loads it),
    or a diffusers directory of the run's architecture."""
    for name, uri in algorithm.stored_policies().items():
        what = f"algorithm.{name}"
        if not uri.startswith("models:"):
            _directory(uri, cfg, what)
            continue
        ref = registered_version(tracker, uri, what)
        tracker.check_loadable(ref)
        src = local_path(ref.source)
        if src is not None and src.is_dir():
            try:
                check_trained_alike(src, cfg, f"{what}={uri}")
            except ValueError as exc:
                raise StoredPolicyError(str(exc)) from None


def stored_sources(algorithm, stores, cfg) -> dict[str, PolicySource]:
    """The stored policies as local directories the engine loads (a version: its checkpoint,
    downloaded into the work directory's policy cache if it is not local)."""
    out = {}
    for name, uri in algorithm.stored_policies().items():
        what = f"algorithm.{name}"
        path = stores.policy_dir(registered_version(stores.tracker, uri, what)) if uri.startswith("models:") \
            else _directory(uri, cfg, what)
        out[name] = PolicySource(path, None, with_optimizer=False)
    return out
