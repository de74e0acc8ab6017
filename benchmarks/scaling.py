"""Scaling of the Ray engine: rollout and update throughput with 1 and 2 workers on the same
total cores, and each Engine call on the Ray engine against the local engine for the same work
(the default recipe's iteration: the same prompts, seeds, sampler recipe, rewards, advantages
and micro-batch plan through the Engine protocol, no stores).

    .venv/bin/python benchmarks/scaling.py [--iterations 4] [--cores 2] [key=value ...]
    .venv/bin/python benchmarks/scaling.py --device cuda --gpus 4 --config qwen_image_geneval model.path=...

On CPU, `--cores C` is split between the workers of a kind (1 worker: C threads; 2 workers: C/2
each); the local engine uses C threads. `--device cuda --gpus N`: N rollout workers and N trainer
ranks, one of each sharing every GPU (stages alternate, as a colocated rollout/trainer layout
runs them), and the report adds images/GPU/s (compare with VeRL-Omni's 0.510 images/GPU/s
for Qwen-Image on 4×H200 at 512², no CFG — state the same conditions when you quote it).
The first iteration (model loading, worker start) is reported apart and left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def work(cfg, iteration: int):
    """The iteration's prompts, seeds and sampler recipe, drawn as the stage layer draws them."""
    from pixrl.algorithms.base import build_algorithm
    from pixrl.datasets.prompts import choose_prompts, load_prompt_set, select_categories
    from pixrl.engines.assets import resolve_asset
    from pixrl.models.registry import get_family
    from pixrl.stages.plan import seed_of

    s = cfg.sampling
    items = select_categories(load_prompt_set(resolve_asset(cfg.dataset.path), cfg.dataset.name), cfg.dataset.categories)
    rng = np.random.default_rng(seed_of(cfg.run.seed, iteration, 0))
    chosen = choose_prompts(items, s.prompts_per_iteration, rng)
    algo = build_algorithm(cfg.algorithm)
    recipe = algo.rollout_recipe(s, rng, get_family(cfg.model.family).semantics.step.value, iteration)
    rows = [(k, g, p) for k, p in enumerate(chosen) for g in range(s.group_size)]
    seeds = [seed_of(cfg.run.seed, iteration, 1, k, g) for k, g, _ in rows]
    return [p.prompt for _, _, p in rows], [p.meta for _, _, p in rows], [k for k, _, _ in rows], seeds, recipe, algo


def one_iteration(engine, cfg, iteration: int) -> dict[str, float]:
    """Seconds of each Engine call for one iteration's work."""
    from pixrl.engines.base import PolicySource
    from pixrl.stages.plan import make_plan

    prompts, metas, groups, seeds, recipe, algo = work(cfg, iteration)
    ids = [f"{iteration:05d}-{i:04d}" for i in range(len(prompts))]
    out = {}
    t = time.perf_counter()
    batch, _ = engine.rollout(PolicySource(), prompts, seeds, recipe)
    out["rollout"] = time.perf_counter() - t
    t = time.perf_counter()
    images = engine.decode(batch["final_latent"] if "final_latent" in batch else batch["tokens"])
    out["decode"] = time.perf_counter() - t
    t = time.perf_counter()
    scores = engine.score(images, prompts, metas, ids)
    out["score"] = time.perf_counter() - t
    adv = algo.advantages(scores["reward"], np.array(groups)).advantages
    batch = batch.with_columns(prompt=prompts, advantage=adv.astype(np.float32), sample_id=ids)
    plan = make_plan(ids, algo.trains_on(adv), cfg.sampling.micro_batch, cfg.algorithm.optimizer_steps_per_iteration)
    row = {sid: i for i, sid in enumerate(ids)}
    t = time.perf_counter()
    engine.train(PolicySource(), batch, [[[row[s] for s in mb] for mb in step] for step in plan.steps], recipe,
                 seed=iteration)
    out["train"] = time.perf_counter() - t
    engine.invalidate()  # the stepped weights are no checkpoint's: the next call starts from the base again
    out["samples"] = float(len(prompts))
    out["trained"] = float(sum(len(mb) for step in plan.steps for mb in step))
    return out


def measure(name: str, make_engine, cfg, iterations: int) -> dict:
    t0 = time.perf_counter()
    engine = make_engine()
    first = one_iteration(engine, cfg, 0)
    first["start_s"] = time.perf_counter() - t0
    runs = [one_iteration(engine, cfg, it) for it in range(1, iterations)]
    if hasattr(engine, "close"):
        engine.close()
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    res = {"engine": name, "first_iteration": first, "median": med,
           "rollout_images_per_s": med["samples"] / med["rollout"],
           "update_samples_per_s": med["trained"] / med["train"] if med["train"] else float("nan")}
    print(json.dumps(res), flush=True)
    return res


GPU_SHARE = 0.5  # of a GPU, per rollout worker and per trainer rank (`--gpus N`: N of each on N GPUs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--cores", type=int, default=2, help="CPU threads in all, per kind of work")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gpus", type=int, default=0, help="GPU workers per kind (rollout, trainer)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import ray
    import torch

    from pixrl.config.loader import load_config
    from pixrl.engines.local import LocalEngine
    from pixrl.engines.ray_engine import RayEngine

    base = [f"model.device={args.device}", *args.overrides]
    results = []
    if not args.gpus:
        local_cfg = load_config(args.config, base + [f"run.threads={args.cores}"])
        torch.set_num_threads(args.cores)
        results.append(measure("local", lambda: LocalEngine(local_cfg), local_cfg, args.iterations))
    ray.init(num_cpus=max(args.cores, 6), num_gpus=args.gpus or None, include_dashboard=False, log_to_driver=False,
             object_store_memory=1024 * 1024 * 1024)
    counts = [args.gpus] if args.gpus else [1, 2]
    for n in counts:
        threads = max(1, args.cores // n)
        per = [f"ray.rollout_workers={n}", f"ray.trainer_workers={n}", "ray.reward_workers=1",
               f"ray.rollout.num_cpus={threads}", f"ray.trainer.num_cpus={threads}", f"run.threads={threads}"]
        if args.gpus:  # a rollout worker and a trainer rank share each GPU: the stages alternate, so
            # N GPUs hold N of each (asking one GPU apiece would leave the trainers unplaced)
            per += [f"ray.rollout.num_gpus={GPU_SHARE}", f"ray.trainer.num_gpus={GPU_SHARE}"]
        cfg = load_config(args.config, base + ["run.engine=ray", *per])
        res = measure(f"ray x{n}", lambda cfg=cfg: RayEngine(cfg), cfg, args.iterations)
        if args.gpus:
            res["images_per_gpu_s"] = res["rollout_images_per_s"] / n
            print(json.dumps({"images_per_gpu_s": res["images_per_gpu_s"], "gpus": n}), flush=True)
        results.append(res)
    ray.shutdown()
    print("\n| engine | rollout img/s | update samples/s | rollout s | decode s | score s | train s | first iteration s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        m = r["median"]
        print(f"| {r['engine']} | {r['rollout_images_per_s']:.1f} | {r['update_samples_per_s']:.1f} | {m['rollout']:.2f} | "
              f"{m['decode']:.2f} | {m['score']:.2f} | {m['train']:.2f} | {r['first_iteration']['start_s']:.1f} |")


if __name__ == "__main__":
    main()
