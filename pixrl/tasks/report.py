"""Prefect artifacts that make a run readable in the UI: per iteration a table of reward
statistics (per component, per prompt category) and a link to the sample grid in MLflow; per run
a progress bar. Keys allow lowercase letters, digits and dashes only."""

from __future__ import annotations

import re

from prefect import task
from prefect.artifacts import (create_markdown_artifact, create_progress_artifact, create_table_artifact,
                               update_progress_artifact)

from ..run import RunSpec
from ..stages.report import grid_path, log_sample_grid, reward_report
from ..stages.session import online_stages


def artifact_key(*parts: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


@task(name="report", persist_result=False)
def report_iteration(spec: RunSpec, iteration: int, progress_id: str | None = None, total: int = 0) -> None:
    """The iteration's sample grid (MLflow), reward table and grid link, and the run's progress bar,
    after the iteration is published (≈0.1 s). Inline on purpose: run in a thread beside the next
    iteration it slowed that iteration's generate by ≈0.45 s on 2 cores — its Python work holds
    the GIL between the sampler's many small ops (benchmarks/interleave.py, 2026-12-01)."""
    stages = online_stages(spec)
    stores = stages.stores  # the run's open stores: no new table handle or MLflow client per iteration
    log_sample_grid(stores, spec.run_id, iteration, stages.cfg.sampling.group_size)
    create_table_artifact(reward_report(stores.table, spec.run_id, iteration), key=artifact_key(spec.run_name, "rewards"),
                          description=f"{spec.run_name} iteration {iteration}: reward per component and category")
    grid = f"{stores.run_artifact_uri}/{grid_path(iteration)}"
    create_markdown_artifact(
        f"### {spec.run_name} · iteration {iteration}\n\nSample grid (one row per prompt, one column per group "
        f"member): `{grid}`\n\nMLflow run `{spec.run_id}` — `mlflow ui --backend-store-uri {spec.tracking_uri}`",
        key=artifact_key(spec.run_name, "samples"), description=f"sample grid of iteration {iteration}")
    if progress_id is not None:
        update_progress(progress_id, iteration + 1, total)


def start_progress(spec: RunSpec) -> str:
    return str(create_progress_artifact(0.0, key=artifact_key(spec.run_name, "progress"),
                                        description=f"{spec.run_name}: iterations done (%)"))


def update_progress(artifact_id: str, done: int, total: int) -> None:
    update_progress_artifact(artifact_id, progress=100.0 * done / max(total, 1))
