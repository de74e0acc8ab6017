"""FSDP against one process, family by family: for each family's tiny checkpoint (`pixrl tiny`),
three optimizer steps of a full fine-tune with a KL reference (flow_grpo β 0.01; Janus-Pro:
its token miniature's Token-GRPO) on one process and on a 2-rank gloo group with
`trainer_sharding=fsdp` semantics (engines/fsdp.py) — without Ray, so it runs in about a
minute a family. Prints the largest weight difference, relative to the weights' scale.

    .venv/bin/python benchmarks/fsdp_families.py [FAMILY ...]    # default: every family
    .venv/bin/python benchmarks/fsdp_families.py --dtype bfloat16 wan   # Wan keeps modules in float32
"""

from __future__ import annotations

import json
import queue
import socket
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_smoke import VARIANTS  # noqa: E402  (stdlib imports only at its module level)

FAMILIES = ["sd3", "flux1", "flux2", "qwen_image", "sana", "wan", "wan_a14b", "janus_pro"]
# another layout of a family (gpu_smoke.VARIANTS) → the steps its trained weights denoise here:
# Wan2.2-A14B trains its low-noise expert, `transformer_2`, the one a meta-built rank fills.
TRAINED_STEPS = {"wan_a14b": (2, 3)}
PROMPTS = ["a red circle", "a blue square", "two green triangles", "a yellow circle"] * 5  # 5 micro-batches of 4


def _config(family: str, work: Path, dtype: str, extra: tuple[str, ...] = ()):
    from pixrl.config.loader import load_config
    from pixrl.models.registry import get_family

    common = ["run.threads=1", "sampling.micro_batch=4", "algorithm.lora.enabled=false", f"run.workdir={work / 'w'}",
              f"model.dtype={dtype}", *extra]
    if family == "janus_pro":
        return load_config("shapes_token_grpo", common)
    written = work / f"tiny-{family}.json"  # the parent writes the checkpoint once; its ranks read it, never
    if written.is_file():                     # rewrite it under each other's feet
        overrides = json.loads(written.read_text())
    else:
        base, options = VARIANTS.get(family, (family, {}))
        overrides = get_family(base).write_tiny(work / f"tiny-{family}", seed=0, **options)
        if (steps := TRAINED_STEPS.get(family)) is not None:
            overrides.update({"model.expert": "low", "sampling.window_range": f"[{steps[0]},{steps[-1] + 1}]"})
        written.write_text(json.dumps(overrides))
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()] + common + [
        "reward=jpeg_compressibility", "sampling.steps=4", "sampling.group_size=4", "algorithm.beta=0.01"])


def _batch(cfg):
    from pixrl.algorithms.sampling import SamplerRecipe
    from pixrl.algorithms.token_sampling import TokenRecipe
    from pixrl.engines.base import PolicySource
    from pixrl.engines.local import LocalEngine

    s = cfg.sampling
    steps = tuple(range(*cfg.sampling.window_range)) if cfg.model.expert else (0, 1)  # the trained expert's
    recipe = TokenRecipe(s.guidance_scale, s.temperature, s.top_k) if cfg.model.family == "janus_pro" else \
        SamplerRecipe(steps=4, noise_level=0.7, sde_steps=steps, train_steps=steps)
    engine = LocalEngine(cfg)
    batch, _ = engine.rollout(PolicySource(), PROMPTS, list(range(len(PROMPTS))), recipe)
    batch = batch.with_columns(prompt=PROMPTS, advantage=np.linspace(-1.5, 1.5, len(PROMPTS)).astype(np.float32))
    mb = [list(range(i, i + 4)) for i in range(0, len(PROMPTS), 4)]
    return engine, batch, [mb[:3], [mb[3]], [mb[4]]], recipe  # a rank replays two of a step, or pads


def _rank(rank: int, family: str, work: Path, master: str, out, dtype: str, extra: tuple[str, ...]) -> None:
    try:
        from pixrl.engines.base import PolicySource
        from pixrl.engines.collective import TorchDistributed
        from pixrl.engines.local import LocalEngine

        torch.set_num_threads(1)
        cfg = _config(family, work, dtype, extra)
        _, batch, plan, recipe = _batch(cfg)
        engine = LocalEngine(cfg)  # fresh: rank 1 builds the trained module on the meta device
        engine.collective = TorchDistributed.join(rank, 2, master, "gloo", sharded=True)
        engine.shard()
        weights = engine.train(PolicySource(), batch, plan, recipe, seed=3).weights
        if rank == 0:
            out.put({k: v.float().numpy() for k, v in weights.items()})
    except Exception:
        traceback.print_exc()
        out.put(None)


def check(family: str, dtype: str = "float32", rank_overrides: tuple[str, ...] = ()) -> float:
    """`rank_overrides`: settings of the sharded ranks only (e.g. activation checkpointing), the
    one-process update being the plain one."""
    from pixrl.engines.base import PolicySource

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        engine, batch, plan, recipe = _batch(_config(family, work, dtype))
        want = engine.train(PolicySource(), batch, plan, recipe, seed=3).weights
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            master = f"127.0.0.1:{s.getsockname()[1]}"
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        ranks = [ctx.Process(target=_rank, args=(r, family, work, master, out, dtype, rank_overrides)) for r in range(2)]
        for p in ranks:
            p.start()
        try:
            got = out.get(timeout=900)
        except queue.Empty:
            got = None
        for p in ranks:  # a rank that failed leaves the other waiting in a collective: stop it
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
                p.join()
    if got is None or set(got) != set(want):
        raise RuntimeError(f"{family}: the sharded update failed or returned other tensors")
    scale = max(float(w.float().abs().max()) for w in want.values())
    return max(float(np.abs(got[k] - want[k].float().numpy()).max()) for k in want) / scale


if __name__ == "__main__":
    args = sys.argv[1:]
    dtype = "float32"
    if args[:1] == ["--dtype"]:
        dtype, args = args[1], args[2:]
    for fam in args or FAMILIES:
        print(f"{fam:12s} {dtype:9s} max |FSDP − one process| / max |w| = {check(fam, dtype):.2e}", flush=True)
