"""GenEval-style evaluation on the shapes world: fixed prompts × fixed seeds, deterministic ODE
sampling, the rule-based judge; accuracy per category and overall (mean of categories, as
GenEval reports it), plus the pooled sample accuracy and mean partial credit."""

from __future__ import annotations

import numpy as np
from ...algorithms.recipe import eval_recipe
from ...algorithms.sampling import SamplerRecipe, generators, sample
from ...algorithms.token_sampling import TokenRecipe, generate_tokens
from ...models.base import uses_negative_prompt
from ..registry import register_evaluator
from .judge import judge
from .prompts import CATEGORIES, split_prompts


def eval_set(split: str, per_category: int = 48, seed: int = 1234) -> list[tuple[dict, int]]:
    """(prompt, seed) pairs: per category, cycle through its prompts up to `per_category` samples."""
    prompts = split_prompts()[split]
    out = []
    for ci, cat in enumerate(CATEGORIES):
        ps = [p for p in prompts if p["category"] == cat]
        for i in range(per_category if ps else 0):
            out.append((ps[i % len(ps)], seed * 1000 + ci * 100_000 + i))
    return out


def generate_images(family, prompts: list[str], seeds: list[int], recipe: SamplerRecipe | TokenRecipe,
                    batch: int = 64) -> np.ndarray:
    """uint8 images for (prompt, seed) pairs with the shared sampler of the family's step kind
    (same as `pixrl generate`)."""
    if isinstance(recipe, TokenRecipe):
        return np.concatenate([
            family.decode(generate_tokens(family, prompts[s:s + batch], generators(seeds[s:s + batch], family.device),
                                          recipe).tokens)
            for s in range(0, len(prompts), batch)])
    neg = family.encode_prompts([""]) if uses_negative_prompt(family, recipe.guidance_scale) else None
    imgs = []
    for s in range(0, len(prompts), batch):
        ps = prompts[s:s + batch]
        cond = family.encode_prompts(ps)
        gens = generators(seeds[s:s + batch], family.device)
        traj = sample(family, cond, neg.expand(len(ps)) if neg is not None else None, gens, recipe)
        imgs.append(family.decode(traj.final))
    return np.concatenate(imgs)


def evaluate(family, split: str, recipe: SamplerRecipe, per_category: int = 48) -> dict:
    items = eval_set(split, per_category)
    imgs = generate_images(family, [p["prompt"] for p, _ in items], [s for _, s in items], recipe)
    per: dict[str, list[float]] = {}
    partial: list[float] = []
    for (p, _), img in zip(items, imgs):
        frames = img if img.ndim == 4 else img[None]  # a clip is judged frame by frame, then averaged
        rs = [judge(f, p) for f in frames]
        per.setdefault(p["category"], []).append(float(np.mean([r["correct"] for r in rs])))
        partial.append(float(np.mean([r["partial"] for r in rs])))
    cats = {k: float(np.mean(v)) for k, v in per.items()}
    return {"accuracy": float(np.mean(list(cats.values()))),
            "sample_accuracy": float(np.mean([x for v in per.values() for x in v])),
            "partial": float(np.mean(partial)), "n": len(items), "split": split, **cats}


@register_evaluator("shapes")
def evaluate_heldout(family, split: str, sampling, per_category: int) -> dict:
    """The registered shapes evaluator: the shared deterministic ODE recipe of `sampling` (a token
    family: its sampling transform)."""
    return evaluate(family, split, eval_recipe(sampling, family.semantics.step.value), per_category)
