"""How fast this machine is right now, as one number a recorded run can carry: the median wall
time of the default recipe's iteration as plain torch (benchmarks/bare_loop.py — same model,
batch and update, no stores). The 2-core machines run the same work 2-3x faster on some days
than others, so a row of the algorithm comparison is read against the probe taken beside it.

    .venv/bin/python benchmarks/machine_probe.py [--iterations 4]     # prints one JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def probe(iterations: int = 4) -> dict:
    """The default recipe's bare iterations 0..n-1; the first (warm-up) is left out of the median."""
    from bare_loop import run_bare

    load = os.getloadavg()[0]  # before the probe adds its own
    t0 = time.time()
    walls = run_bare([], iterations)
    kept = walls[1:] or walls
    return {"probe_s_per_iteration": statistics.median(kept), "probe_walls_s": [round(w, 3) for w in walls],
            "probe_wall_s": round(time.time() - t0, 1), "cpu_model": _cpu_model(), "cpus": os.cpu_count(),
            "load_average_1m_before": load, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=4)
    print(json.dumps(probe(ap.parse_args().iterations)))


if __name__ == "__main__":
    main()
