"""Which failures a task retry can fix.

A retry is safe for every stage (each one checks the stores first and writes once), but only
worth it for faults outside our control: a dropped connection to a remote judge, a timeout, a
busy SQLite file, a flaky disk. Deterministic errors — a bad config, a NaN reward, a missing or
corrupted checkpoint, a bug — fail on the first attempt with their message, because a retry
would only repeat them. The whole cause chain is inspected, so a scorer's ConnectionError
wrapped in a ScoringError still counts as transient.
"""

from __future__ import annotations

import errno

from ..errors import exception_chain


class TransientError(RuntimeError):
    """Raise (or wrap) a fault that the same call may not hit again, e.g. a judge server's 503."""


# OSErrors that say something about the request, not the moment: retrying cannot help.
_PERMANENT_OS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
_PERMANENT_ERRNO = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.EEXIST}
_TRANSIENT_MESSAGES = ("database is locked", "temporarily unavailable", "connection reset", "timed out")


def is_transient(exc: BaseException | None) -> bool:
    """True if any exception in exc's cause chain is a fault a retry can fix."""
    if exc is None or not isinstance(exc, BaseException):
        return False
    for e in exception_chain(exc):
        if isinstance(e, (TransientError, ConnectionError, TimeoutError)):
            return True
        if isinstance(e, OSError) and not isinstance(e, _PERMANENT_OS) and e.errno not in _PERMANENT_ERRNO:
            return True
        if any(m in str(e).lower() for m in _TRANSIENT_MESSAGES):
            return True
    return False
