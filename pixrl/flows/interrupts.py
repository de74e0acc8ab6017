"""How a flow's MLflow run ends when an exception stops it: an interrupt is KILLED, anything else
FAILED. Here (not in artifacts/) because Prefect's own TerminationSignal is one of the carriers."""

from __future__ import annotations

from prefect.exceptions import TerminationSignal


def end_status(exc: BaseException) -> str:
    """KILLED for an interrupt anywhere in the exception's chain — SIGINT, SIGTERM as the CLI's
    KeyboardInterrupt, or Prefect's TerminationSignal — FAILED otherwise."""
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        if isinstance(e, (KeyboardInterrupt, SystemExit, TerminationSignal)):
            return "KILLED"
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return "FAILED"
