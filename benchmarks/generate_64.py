"""Time to generate 64 images with the embedded miniature and the eval sampler (20-step ODE),
as `pixrl generate` / `pixrl eval` do. Model loading is excluded and reported separately.

    .venv/bin/python benchmarks/generate_64.py [--steps 20] [--guidance 1.0] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from pixrl.algorithms.sampling import SamplerRecipe
from pixrl.config.environment import apply_defaults
from pixrl.config.schema import DatasetConfig
from pixrl.datasets.prompts import split_items
from pixrl.datasets.shapes.evaluate import eval_set, generate_images
from pixrl.engines.assets import resolve_asset
from pixrl.models.sd3 import SD3Family


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--guidance", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    apply_defaults()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    fam = SD3Family.load(resolve_asset("builtin:mini_shapes"), max_sequence_length=0)
    load_s = time.perf_counter() - t0
    items = eval_set(split_items(DatasetConfig(), "heldout"), per_category=13)[:64]
    recipe = SamplerRecipe(steps=a.steps, noise_level=0.0, guidance_scale=a.guidance)
    generate_images(fam, [p["prompt"] for p, _ in items[:4]], [s for _, s in items[:4]], recipe)  # warm-up
    t1 = time.perf_counter()
    imgs = generate_images(fam, [p["prompt"] for p, _ in items], [s for _, s in items], recipe)
    gen_s = time.perf_counter() - t1
    print(f"{len(imgs)} images, {a.steps} steps, cfg {a.guidance}, {a.threads} threads: {gen_s:.2f} s "
          f"({len(imgs) / gen_s:.1f} images/s); model load {load_s:.2f} s")


if __name__ == "__main__":
    main()
