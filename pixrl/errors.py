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


def exception_chain(exc: BaseException | None):
    """`exc`, then its cause (or context), and so on, each once: what a task's failure carries
    when Prefect or a scorer wraps the original error."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def expected_in_chain(exc: BaseException | None) -> ExpectedError | None:
    """The first ExpectedError in `exc`'s cause/context chain, or None."""
    return next((e for e in exception_chain(exc) if isinstance(e, ExpectedError)), None)
