"""Fault injection for resume drills: `PIXRL_FAULT=<stage>@<iteration>:<kind>` makes the stage
fail at its most delicate point — after its work, before its single commit (publish: after
the version is registered, before the alias moves).

kind: `raise` (a deterministic error), `transient` (a TransientError, once per process, so a
task retry gets past it), `sigkill` (the process dies without cleanup, as under the OOM killer
or a lost node) or `stall` (the stage waits there for up to 10 minutes: a drill sends a signal
from outside at that moment). Several faults can be given, comma-separated. Unset, it costs
nothing.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

from .faults import TransientError

ENV = "PIXRL_FAULT"
CHAOS_ENV = "PIXRL_CHAOS"
KINDS = ("raise", "transient", "sigkill", "stall")
STALL_S = 600
_fired: set[str] = set()
_attempts: dict[tuple[str, int], int] = {}


class InjectedFault(RuntimeError):
    """A deterministic failure injected by PIXRL_FAULT."""


def _parse(value: str) -> list[tuple[str, int, str]]:
    faults = []
    for item in filter(None, (v.strip() for v in value.split(","))):
        try:
            where, kind = item.split(":")
            stage, it = where.split("@")
            faults.append((stage, int(it), kind))
        except ValueError:
            raise ValueError(f"{ENV}={value!r}: expected <stage>@<iteration>:<kind>, e.g. update@1:sigkill") from None
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    return faults


def _chaos(stage: str, iteration: int, value: str) -> None:
    try:
        p_text, _, seed = value.partition(":")
        p = float(p_text)
    except ValueError:
        raise ValueError(f"{CHAOS_ENV}={value!r}: expected <probability>[:<seed>], e.g. 0.05:7") from None
    attempt = _attempts.get((stage, iteration), 0)
    _attempts[(stage, iteration)] = attempt + 1
    digest = hashlib.sha256(f"{seed}|{os.getpid()}|{stage}|{iteration}|{attempt}".encode()).digest()
    if int.from_bytes(digest[:8], "big") / 2**64 < p:
        msg = (f"injected random transient fault in {stage} (iteration {iteration}, attempt {attempt + 1}; "
               f"{CHAOS_ENV}={value})")
        print(f"pixrl chaos: {msg}", file=sys.stderr, flush=True)  # a drill counts these lines
        raise TransientError(msg)


def fault_point(stage: str, iteration: int) -> None:
    chaos = os.environ.get(CHAOS_ENV)
    if chaos:
        _chaos(stage, iteration, chaos)
    value = os.environ.get(ENV)
    if not value:
        return
    for f_stage, f_it, kind in _parse(value):
        if (f_stage, f_it) != (stage, iteration):
            continue
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "stall":
            time.sleep(STALL_S)
            continue
        key = f"{stage}@{iteration}:{kind}"
        if kind == "transient":
            if key in _fired:
                continue
            _fired.add(key)
            raise TransientError(f"injected transient fault in {stage} (iteration {iteration})")
        raise InjectedFault(f"injected fault in {stage} (iteration {iteration})")
