"""Where does a policy put each shape on position prompts? Measures, per prompt, how often the two
named shapes are detected and how often the first-named one sits on the left (horizontal prompts)
or on top (vertical prompts), for the base miniature and (optionally) a trained run. A model that
reads the relation puts the first-named shape there for "left of"/"above" and not for "right
of"/"below"; one that does not stays near 0.5 whatever the words (or follows a per-pair habit).

    .venv/bin/python benchmarks/position_bias.py [--run NAME --workdir DIR | --checkpoint PATH] [--samples 48]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from pixrl.algorithms.recipe import eval_recipe
from pixrl.datasets.shapes.evaluate import generate_images
from pixrl.datasets.shapes.judge import locate
from pixrl.datasets.shapes.prompts import split_prompts
from pixrl.stages.inference import load_policy


def measure(family, recipe, prompts: list[dict], samples: int) -> list[dict]:
    rows = []
    for p in prompts:
        imgs = generate_images(family, [p["prompt"]] * samples, [7000 + i for i in range(samples)], recipe)
        found = first_left = 0
        horizontal = p["relation"] in ("left of", "right of")
        for img in imgs:
            mapping = locate(img, p)
            if len(mapping) == 2:
                found += 1
                a, b = mapping[0], mapping[1]
                first_left += (a.cx < b.cx) if horizontal else (a.cy < b.cy)
        rows.append({"prompt": p["prompt"], "both_found": found / samples,
                     "first_named_left_or_top": first_left / max(found, 1),
                     "asked_first_left_or_top": p["relation"] in ("left of", "above")})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default=None)
    ap.add_argument("--workdir", default="work")
    ap.add_argument("--checkpoint", default=None, help="a diffusers directory or pixrl checkpoint instead of --run")
    ap.add_argument("--skip-base", action="store_true")
    ap.add_argument("--samples", type=int, default=48)
    args = ap.parse_args()
    split = split_prompts()
    positions = {s: [p for p in split[s] if p["relation"]] for s in ("train", "heldout")}
    out = {}
    for label, ckpt, run in (("base", None, None), ("run", args.checkpoint, args.run)):
        if (label == "run" and run is None and ckpt is None) or (label == "base" and args.skip_base):
            continue
        policy, cfg = load_policy(ckpt, run, args.workdir)
        recipe = eval_recipe(cfg.sampling)
        out[label] = {s: measure(policy.family, recipe, ps, args.samples) for s, ps in positions.items()}
        for s, rows in out[label].items():
            for r in rows:
                asked = "yes" if r["asked_first_left_or_top"] else "no"
                print(f"{label:5s} {s:8s} {r['prompt']:38s} both found {r['both_found']:.2f}  "
                      f"first-named left/top {r['first_named_left_or_top']:.2f}  (asked: {asked})")
    print(json.dumps(out))


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
