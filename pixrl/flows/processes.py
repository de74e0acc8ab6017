"""Process facts from Linux /proc, for stopping what a run started (serve's flow runs) and for the
drills that check nothing outlives its owner (tests, benchmarks/soak.py). Empty off Linux."""

from __future__ import annotations

import os


def children(pid: int) -> list[int]:
    """Direct children of `pid`."""
    if not os.path.isdir("/proc"):
        return []
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                continue
    return out


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
