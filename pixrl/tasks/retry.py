"""Per-task retry options from the run config: exponential backoff with jitter, and a retry
condition that lets only transient faults retry (deterministic errors fail fast)."""

from __future__ import annotations

from ..config.schema import RunConfig
from ..stages.faults import is_transient


def retry_transient_only(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: the failed state's data is the raised exception."""
    return is_transient(state.data if isinstance(state.data, BaseException) else None)


def with_retries(task, run: RunConfig):
    """The task with the configured retries for its stage (its name)."""
    r = run.retries.get(task.name)
    if r is None or r.retries == 0:
        return task.with_options(retries=0)
    delays = [r.delay_s * r.backoff**i for i in range(r.retries)]
    return task.with_options(retries=r.retries, retry_delay_seconds=delays, retry_jitter_factor=r.jitter,
                             retry_condition_fn=retry_transient_only)
