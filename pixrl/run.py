"""Neutral ground between the stage layer and the engines: what identifies a run (RunSpec) and
where every file of it lives under the work directory (RunLayout).

Both are small, frozen and picklable — Prefect passes the spec to every task — and neither
knows about Prefect, MLflow calls or compute. The config is validated once per process per
spec (`RunSpec.cfg` is cached), not once per stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .config.schema import ExperimentConfig


@dataclass(frozen=True)
class RunLayout:
    """Every path of one run under its work directory."""

    workdir: Path
    run_name: str
    run_id: str

    @property
    def checkpoints(self) -> Path:
        return self.workdir / "checkpoints" / self.run_name / self.run_id

    def checkpoint(self, iteration: int) -> Path:
        return self.checkpoints / f"it_{iteration:04d}"

    @property
    def records(self) -> Path:
        return self.workdir / "records" / self.run_name / self.run_id

    def record(self, stage: str, iteration: int | None) -> Path:
        """The metrics record of a committed stage (per iteration, or per run when None)."""
        return (self.records / f"it_{iteration:04d}" if iteration is not None else self.records) / f"{stage}.json"

    def policy_cache(self, model_name: str, version: int, suffix: str = "") -> Path:
        """Where versions published by other runs are downloaded to (once)."""
        return self.workdir / "cache" / "policies" / f"{model_name}-v{version}{suffix}"


@dataclass(frozen=True)
class RunSpec:
    """Everything a stage needs to find its run: small and serialisable, passed to every task."""

    config: dict
    run_id: str  # MLflow run id; also the run_id column of the trajectory table
    run_name: str
    workdir: str
    tracking_uri: str
    table_uri: str
    model_name: str

    @cached_property
    def cfg(self) -> ExperimentConfig:
        return ExperimentConfig.model_validate(self.config)

    @property
    def layout(self) -> RunLayout:
        return RunLayout(Path(self.workdir), self.run_name, self.run_id)

    def __getstate__(self) -> dict:  # the cached config is rebuilt, not shipped
        return {k: v for k, v in self.__dict__.items() if k != "cfg"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def table_uri(cfg: ExperimentConfig, workdir: Path) -> str:
    root = cfg.run.store_root or str((Path(workdir) / "lance").resolve())
    return f"{root.rstrip('/')}/{cfg.run.name}/trajectories.lance"


def run_spec(cfg: ExperimentConfig, workdir: Path, run_id: str, model_name: str | None = None) -> RunSpec:
    """Where a run's stores are, from its config, work directory and MLflow run id. The registered
    model is the experiment's (`<experiment>-policy`) unless the run recorded another one."""
    from .artifacts.tracking import default_tracking_uri, policy_model_name

    wd = Path(workdir).resolve()
    return RunSpec(config=cfg.model_dump(mode="json"), run_id=run_id, run_name=cfg.run.name, workdir=str(wd),
                   tracking_uri=cfg.run.tracking_uri or default_tracking_uri(wd), table_uri=table_uri(cfg, wd),
                   model_name=model_name or policy_model_name(cfg.run.experiment))
