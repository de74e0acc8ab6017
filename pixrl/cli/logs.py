"""What the terminal shows besides pixrl's own lines: third-party INFO logging stays quiet unless
`pixrl --verbose`; an expected error (pixrl.errors.ExpectedError) raised inside a Prefect flow or
task is not echoed with its traceback by Prefect's console handler — the CLI prints its one-line
message — unless `pixrl --debug`. Prefect's API log handler still receives the full record, so the
Prefect UI shows the traceback of every failed task either way."""

from __future__ import annotations

import logging
import os

from ..config.environment import DEFAULTS
from ..errors import expected_in_chain

# the library loggers and environment switches that pixrl quiets by default (config/environment.py)
VERBOSE_ENV = {"PREFECT_LOGGING_LEVEL": "INFO", "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
               "MLFLOW_LOGGING_LEVEL": "INFO", "TRANSFORMERS_VERBOSITY": "info",
               "DIFFUSERS_VERBOSITY": "info"}
VERBOSE_LOGGERS = ("prefect", "mlflow", "alembic", "transformers", "diffusers")


class _Options:
    verbose = False
    debug = False


OPTIONS = _Options()


def configure(verbose: bool, debug: bool) -> None:
    """Called once by the CLI before any command: set the switches the libraries read at import
    (only those the user left at pixrl's defaults) and the levels of those already imported."""
    OPTIONS.verbose, OPTIONS.debug = verbose or debug, debug
    if not OPTIONS.verbose:
        return
    for key, value in VERBOSE_ENV.items():
        if os.environ.get(key) == DEFAULTS.get(key):
            os.environ[key] = value
    for name in VERBOSE_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)


class DropExpectedFailures(logging.Filter):
    """Console filter: a record carrying an expected error is the failure the CLI explains in
    one line; Prefect's copies (the failure with its traceback, then "Finished in state
    Failed('… ErrorName: message')") would bury that line. The first carries the exception; the
    ones after it are recognised by the exception's text."""

    def __init__(self) -> None:
        super().__init__()
        self._dropped: list[str] = []  # "ErrorName: message" of the latest expected failures

    def filter(self, record: logging.LogRecord) -> bool:
        if OPTIONS.debug:
            return True
        if record.exc_info:
            exc = expected_in_chain(record.exc_info[1])
            if exc is None:
                return True
            self._dropped = [*self._dropped[-15:], f"{type(exc).__name__}: {exc}"]
            return False
        return not (self._dropped and record.levelno >= logging.ERROR
                    and any(text in record.getMessage() for text in self._dropped))


def quiet_expected_failures() -> None:
    """Attach the filter to Prefect's console handlers (after Prefect configured logging; idempotent)."""
    import prefect.main  # noqa: F401  (configures Prefect's logging on first import)

    loggers = [logging.getLogger()] + [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
                                       if n.startswith("prefect")]
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and not any(isinstance(f, DropExpectedFailures) for f in h.filters):
                h.addFilter(DropExpectedFailures())
