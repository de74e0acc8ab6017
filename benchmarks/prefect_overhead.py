"""What Prefect's bookkeeping costs per iteration, on this machine, against its temporary API
server — the measurements behind the shape of the online flow (flows/online.py):

- six trivial tasks called from a flow (what an iteration is now);
- the same six tasks inside a sync subflow per iteration (what it was: flow-run creation, its
  tracking task, state proposals and the heartbeat thread's join);
- the six tasks under a `tags(...)` context (a tagged task asks the API for concurrency slots).

    .venv/bin/python benchmarks/prefect_overhead.py [--iterations 8]

Prints the median seconds per iteration of each. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

from prefect import flow, tags, task


@task(persist_result=False)
def stage(x: int) -> int:
    return x + 1


def six_tasks(x: int) -> int:
    for i in range(6):
        x = stage.with_options(task_run_name=f"stage{i}")(x)
    return x


@flow(name="bench-iteration")
def iteration_subflow(x: int) -> int:
    return six_tasks(x)


def tagged(x: int) -> int:
    with tags(f"iteration:{x}"):
        return six_tasks(x)


@flow(name="bench-prefect-overhead")
def measure(iterations: int) -> dict[str, float]:
    out = {}
    six_tasks(0)  # warm the client and the server
    for name, fn in (("six tasks in the flow run", six_tasks), ("a subflow of six tasks", iteration_subflow),
                     ("six tagged tasks", tagged)):
        walls = []
        for i in range(iterations):
            t0 = time.perf_counter()
            fn(i)
            walls.append(time.perf_counter() - t0)
        out[name] = statistics.median(walls)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=8)
    a = ap.parse_args()
    from pixrl.config.environment import apply_defaults
    from pixrl.flows.api_server import start_local_api

    apply_defaults()
    start_local_api()
    res = measure(a.iterations)
    print("| per iteration | median s |\n|---|---|")
    for name, s in res.items():
        print(f"| {name} | {s:.3f} |")


if __name__ == "__main__":
    main()
