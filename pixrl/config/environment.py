"""Quiet, offline defaults for the libraries pixrl drives (set only where the user has not)."""

from __future__ import annotations

import os

DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # no telemetry DNS errors on closed networks
    "PREFECT_LOGGING_LEVEL": "WARNING",
    # the temporary API server's own log (its stderr is the terminal's): stopping it while its
    # task-run recorder flushes prints a CancelledError traceback per pending event, after the run
    # has finished well; a failure that matters reaches the run as a failed API call
    "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",  # a first start migrates the DB (slow CI)
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "HF_HUB_OFFLINE": "1",  # nothing is ever downloaded from a hub at run time
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # no "Creating initial MLflow database tables" amid the progress lines
}


def apply_defaults() -> None:
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
