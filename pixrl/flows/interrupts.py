"""How a flow's MLflow run ends when an exception stops it: an interrupt is KILLED, anything else
FAILED. Here (not in artifacts/) because Prefect's own TerminationSignal is one of the carriers."""

from __future__ import annotations

from prefect.exceptions import TerminationSignal

from ..errors import exception_chain


def end_status(exc: BaseException) -> str:
    """KILLED for an interrupt anywhere in the exception's chain — SIGINT, SIGTERM as the CLI's
    KeyboardInterrupt, or Prefect's TerminationSignal — FAILED otherwise."""
    interrupted = (KeyboardInterrupt, SystemExit, TerminationSignal)
    return "KILLED" if any(isinstance(e, interrupted) for e in exception_chain(exc)) else "FAILED"
