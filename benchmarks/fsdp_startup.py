"""FSDP start-up memory: what each rank of a 2-rank gloo group holds while the trained module is
loaded and sharded (`ray.trainer_sharding=fsdp`, engines/fsdp.py), for a random model of a
family's real shapes (benchmarks/gpu_smoke.py's builders; default SD3.5-Medium, bf16).

Three ways, measured one after the other on the same checkpoint:
- `every-rank-loads`: each rank loads the whole checkpoint, then shards (what start-up did
  before rank 0 alone read the trained module);
- `rank-0-loads+text`: rank 0 loads the trained module into host memory, rank 1 builds it with
  no storage and receives its shards; both load the text encoders (what start-up did before
  trainer ranks took the rollout's encodings);
- `rank-0-loads` (what a Ray trainer rank does): the same, with no text encoders read.

Per rank: peak resident memory (the process's high-water mark), resident memory once sharded,
the trained module's bytes the rank holds, and the seconds from engine start to sharded.

    .venv/bin/python benchmarks/fsdp_startup.py [--family sd3] [--layers N] [--workdir DIR]

On 24 GB of RAM the SD3.5-M shapes fit with `--layers 12` (every rank loading the whole model
is what does not fit at 24).
"""

from __future__ import annotations

import argparse
import json
import queue
import resource
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp

MODES = ("every-rank-loads", "rank-0-loads+text", "rank-0-loads")


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def _rank(rank: int, master: str, mode: str, overrides: list[str], out) -> None:
    try:
        import torch

        from pixrl.config.loader import load_config
        from pixrl.engines.collective import TorchDistributed
        from pixrl.engines.fsdp import local_bytes
        from pixrl.engines.local import LocalEngine

        torch.set_num_threads(1)
        t0 = time.perf_counter()
        engine = LocalEngine(load_config(None, overrides))
        engine.text_towers = mode != "rank-0-loads"  # as TrainerWorker sets it for a diffusers family
        engine.collective = TorchDistributed.join(rank, 2, master, "gloo", sharded=True)
        if mode == "every-rank-loads":
            engine.policy  # the whole checkpoint, on this rank too, before sharding
        engine.shard()
        pol = engine.policy
        held = local_bytes(list(pol.module.parameters()))
        copies = sum(local_bytes(list(m.parameters())) for m in (pol._reference, pol._frozen) if m is not None)
        text = local_bytes([q for m in pol.family.text_towers().values() for q in m.parameters()])
        out.put({"rank": rank, "mode": mode, "seconds": round(time.perf_counter() - t0, 1),
                 "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                 "rss_sharded_gib": round(_rss_gib(), 2), "module_gib": round(held / 2**30, 2),
                 "frozen_copies_gib": round(copies / 2**30, 2), "text_towers_gib": round(text / 2**30, 2)})
    except Exception:
        traceback.print_exc()
        out.put({"rank": rank, "mode": mode, "error": True})


def measure(mode: str, overrides: list[str]) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = f"127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, master, mode, overrides, out)) for r in range(2)]
    for p in procs:
        p.start()
    rows = []
    while len(rows) < len(procs):
        try:
            rows.append(out.get(timeout=10))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:  # killed (out of memory: SIGKILL) before it could report
                for p in procs:
                    p.kill()
                raise SystemExit(f"{mode}: rank {dead[0]} died (exit code {procs[dead[0]].exitcode}); "
                                 f"a smaller model (--layers) fits this machine")
    for p in procs:
        p.join()
    return sorted(rows, key=lambda r: r["rank"])


def _build(model: Path, family: str, layers: int | None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_smoke import build_model

    build_model(model, False, 512, family, layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="sd3")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lora", action="store_true", help="LoRA (no frozen copy) instead of a full fine-tune with a KL reference")
    ap.add_argument("--workdir", default=None, help="reuse the random checkpoint built there by an earlier run")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="pixrl-fsdp-startup-"))
    model = work / "model"
    t0 = time.perf_counter()
    if not (model / "model_index.json").is_file() and not (model / "config.json").is_file():
        builder = mp.get_context("spawn").Process(target=_build, args=(model, args.family, args.layers))
        builder.start()  # apart: this process must not hold the model while the ranks are measured
        builder.join()
    print(f"checkpoint {model} ({time.perf_counter() - t0:.0f} s to build)", flush=True)
    overrides = [f"model.family={args.family}", f"model.path={model}", f"model.dtype={args.dtype}",
                 "model.device=cpu", "model.resolution=512", f"run.workdir={work / 'run'}", "run.threads=1",
                 "reward=jpeg_compressibility", "dataset.categories=null",
                 *(["algorithm.lora.enabled=true"] if args.lora else ["algorithm.lora.enabled=false",
                                                                       "algorithm.beta=0.01"])]
    if args.family == "sd3":
        overrides.append("model.max_sequence_length=0")
    rows = [row for mode in MODES for row in measure(mode, overrides)]
    print(f"{'mode':18s} {'rank':>4s} {'peak RSS':>9s} {'RSS sharded':>12s} {'module':>7s} {'copies':>7s} {'text':>6s} {'s':>6s}")
    for r in rows:
        if r.get("error"):
            print(f"{r['mode']:18s} {r['rank']:4d}  failed (traceback above)")
            continue
        print(f"{r['mode']:18s} {r['rank']:4d} {r['peak_rss_gib']:8.2f}G {r['rss_sharded_gib']:11.2f}G "
              f"{r['module_gib']:6.2f}G {r['frozen_copies_gib']:6.2f}G {r['text_towers_gib']:5.2f}G {r['seconds']:6.1f}")
    print(json.dumps({"family": args.family, "dtype": args.dtype, "lora": args.lora, "rows": rows}))


if __name__ == "__main__":
    main()
