"""Expected errors: a bad config, path, source or run name, a refused lock, a pruned checkpoint —
failures whose message already names the problem and the fix. The CLI prints that message alone
(one line, exit code 2 or 1) and the console log drops their traceback (`pixrl --debug` keeps it),
wherever they are raised: in the CLI, or inside a Prefect flow or task, whose engine logs every
failure with its traceback. Anything else is a bug or a runtime failure and keeps its traceback.

Kept free of imports so that every layer (config, artifacts, stages, rewards) can mark its own
errors without depending on the CLI or Prefect."""

from __future__ import annotations


class ExpectedError(Exception):
    """Base (usually mixed in before the builtin it specialises: `class X(ExpectedError, ValueError)`)
    of the errors a user fixes from the message alone."""


def expected_in_chain(exc: BaseException | None) -> ExpectedError | None:
    """The first ExpectedError in `exc`'s cause/context chain (Prefect re-raises task failures
    wrapped or chained), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ExpectedError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
