"""The pipeline and the bare loop over the same iterations, interleaved in chunks.

On a shared 2-core machine the compute speed of the same work wanders by 5–20% within minutes
(measured: one generate of the default recipe took 4.2–6.2 s in six consecutive runs), so a
pipeline run followed by a bare-loop run measures the machine as much as the pipeline. Here the
iterations are cut into chunks; each chunk runs once through `pixrl train`/`pixrl resume` (the
run stopped at the next chunk's first generate by an injected fault, as a killed run would be)
and once through the bare loop, in the order B P | P B | B P | … so that both meet the same
machine. The first iteration of every chunk is left out of both medians (the pipeline loads its
model there). Reported: the ratio of median iteration walls over the same iterations, and the
compute inside the stages against the bare loop's phases, so a gap shows whether the pipeline's
compute ran slower or its bookkeeping added time.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Interleaved:
    info: dict  # the last `pixrl` chunk's JSON summary (run id, table URI, …)
    first_start: float  # time.time() when the first pipeline chunk started
    first_s: float  # its wall seconds (start-up included)
    chunk_starts: list[int]
    bare_walls: dict[int, float] = field(default_factory=dict)
    bare_phases: dict[int, dict[str, float]] = field(default_factory=dict)


def run_interleaved(first_cmd: list[str], resume_cmd: list[str], env: dict, start: int, end: int, chunk: int,
                    bare) -> Interleaved:
    """Iterations start..end-1: pipeline chunks (the first with `first_cmd`, then `resume_cmd`) and
    `bare` (a BareLoop, or None for no comparison) over the same chunks."""
    starts = list(range(start, end, chunk))
    res = Interleaved({}, 0.0, 0.0, starts)
    for i, c0 in enumerate(starts):
        c1 = min(c0 + chunk, end)

        def pipeline() -> None:
            fault = {"PIXRL_FAULT": f"generate@{c1}:raise"} if c1 < end else {}
            t_wall, t0 = time.time(), time.perf_counter()
            out = subprocess.run(first_cmd if i == 0 else resume_cmd, capture_output=True, text=True,
                                 env={**env, **fault}, check=False)
            if i == 0:
                res.first_start, res.first_s = t_wall, time.perf_counter() - t0
            if c1 < end:
                if out.returncode == 0 or f"injected fault in generate (iteration {c1})" not in " ".join(out.stderr.split()):
                    sys.exit(f"expected the chunk {c0}–{c1 - 1} to stop at iteration {c1}'s generate "
                             f"(rc {out.returncode}):\n{out.stderr[-3000:]}")
            elif out.returncode:
                sys.exit(f"the last chunk {c0}–{c1 - 1} failed:\n{out.stderr[-3000:]}")
            else:
                res.info = json.loads(out.stdout.strip().splitlines()[-1])

        def bare_chunk() -> None:
            for it in range(c0, c1):
                res.bare_walls[it] = bare.iteration(it)
                res.bare_phases[it] = {name: secs[-1] for name, secs in bare.phases.items()}

        for step in ((bare_chunk, pipeline) if i % 2 == 0 else (pipeline, bare_chunk)):
            if step is pipeline or bare is not None:
                step()
        print(f"chunk {c0}–{c1 - 1} done ({'bare, pipeline' if i % 2 == 0 else 'pipeline, bare'})", flush=True)
    return res


def measured_iterations(res: Interleaved, start: int, end: int) -> list[int]:
    return [it for it in range(start, end) if it not in res.chunk_starts]


def report(client, run_id: str, res: Interleaved, measured: list[int]) -> None:
    """The ratio of median iteration walls over `measured`, and where a gap is."""
    if not res.bare_walls:
        return

    def by_step(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, key)}

    walls = by_step("time/iteration_s")
    pipe = statistics.median(walls[it] for it in measured)
    bare = statistics.median(res.bare_walls[it] for it in measured)
    print(f"\nbare loop interleaved with the pipeline in chunks starting at {res.chunk_starts} (each chunk's first "
          f"iteration left out of both): median {bare:.2f} s/iteration; pipeline {pipe:.2f}; "
          f"pipeline / bare = **{pipe / bare:.3f}** over {len(measured)} iterations")
    rows = []
    for stage, phase in (("generate", "generate"), ("decode", "decode"), ("score", "score"), ("update", "update")):
        inside = by_step(f"{stage}_compute_s")
        if inside and all(it in inside for it in measured):
            rows.append(f"{stage} {statistics.median(inside[it] for it in measured):.2f} vs "
                        f"{statistics.median(res.bare_phases[it][phase] for it in measured):.2f}")
    if rows:
        print("compute inside the pipeline's stages vs the bare loop's phases (median s): " + "; ".join(rows))


def bare_loop(overrides: list[str], init_checkpoint: Path | None):
    """A BareLoop for the benchmark's recipe, from the base weights or a checkpoint's."""
    from bare_loop import BareLoop

    from pixrl.config.loader import load_config

    init = None
    if init_checkpoint is not None:
        from pixrl.artifacts.checkpoints import load_weights

        init = load_weights(init_checkpoint)
    return BareLoop(load_config(None, ["run.eval_every=0", *overrides]), init)
