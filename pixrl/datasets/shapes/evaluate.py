"""GenEval-style evaluation on the shapes world: fixed prompts × fixed seeds, deterministic ODE
sampling, the rule-based judge; accuracy per category and overall (mean of categories, as
GenEval reports it) with a 95% bootstrap interval, plus the pooled sample accuracy and mean
partial credit. The prompts are the dataset's prompt file for the split (dataset.path /
dataset.heldout_path), so a checkpoint is evaluated on the world it was pretrained for."""

from __future__ import annotations

import numpy as np
from ...algorithms.recipe import eval_recipe
from ...algorithms.sampling import SamplerRecipe, generators, sample
from ...algorithms.token_sampling import TokenRecipe, generate_tokens
from ...models.base import conditioning_to, decode_images, negative_prompt_of
from ..registry import register_evaluator
from .judge import judge
from .prompts import CATEGORIES

#: the seed set every evaluation of every run shares (sample i of category c: EVAL_SEED·1000 + c·100000 + i)
EVAL_SEED = 1234
BOOTSTRAP_DRAWS = 2000


def _meta(item) -> dict:
    """A prompt item (PromptItem, or a dict with 'prompt' and the metadata) as the judge's dict."""
    return item if isinstance(item, dict) else {"prompt": item.prompt, **item.meta}


def eval_set(items, per_category: int = 48, seed: int = EVAL_SEED) -> list[tuple[dict, int]]:
    """(prompt, seed) pairs: per category, cycle through its prompts (in file order) up to
    `per_category` samples; the seeds depend only on the category and the sample's index."""
    prompts = [_meta(it) for it in items]
    out = []
    for ci, cat in enumerate(CATEGORIES):
        ps = [p for p in prompts if p.get("category") == cat]
        for i in range(per_category if ps else 0):
            out.append((ps[i % len(ps)], seed * 1000 + ci * 100_000 + i))
    return out


def bootstrap_interval(per_category: dict[str, list[float]], draws: int = BOOTSTRAP_DRAWS,
                       level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of the mean-of-categories accuracy, resampling each category's samples
    with replacement (stratified, so every draw keeps the categories' sizes)."""
    rng = np.random.default_rng(seed)
    stats = np.zeros(draws)
    for vals in per_category.values():
        v = np.asarray(vals, dtype=np.float64)
        stats += v[rng.integers(0, len(v), size=(draws, len(v)))].mean(axis=1)
    stats /= len(per_category)
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def generate_images(family, prompts: list[str], seeds: list[int], recipe: SamplerRecipe | TokenRecipe,
                    batch: int = 64, encoded: dict | None = None, images: list[bytes] | None = None,
                    soundtracks: list | None = None) -> np.ndarray:
    """uint8 images for (prompt, seed) pairs with the shared sampler of the family's step kind
    (same as `pixrl generate`). `encoded`: `prompt_encodings` of these prompts from a process with
    the text towers, used instead of encoding here (the same bits). `images`: each prompt's
    source image (an editing family). `soundtracks`: a list that receives each clip's
    (waveform [channels, samples], sample rate), for a family whose clips have sound (`audio`)."""
    if isinstance(recipe, TokenRecipe):
        return np.concatenate([
            decode_images(family, generate_tokens(family, prompts[s:s + batch], generators(seeds[s:s + batch],
                                                                                            family.device), recipe).tokens,
                          prompts[s:s + batch])
            for s in range(0, len(prompts), batch)])
    on = lambda cond: None if cond is None else conditioning_to(cond, family.device)  # noqa: E731
    negs = [on(n) for n in encoded["negatives"]] if encoded is not None else \
        _negatives(family, recipe, len(prompts), batch, images)
    imgs = []
    for k, s in enumerate(range(0, len(prompts), batch)):
        ps = prompts[s:s + batch]
        cond = on(encoded["batches"][k]) if encoded is not None else \
            family.encode_prompts(ps, images[s:s + batch]) if images is not None else family.encode_prompts(ps)
        gens = generators(seeds[s:s + batch], family.device)
        final = sample(family, cond, negs[k], gens, recipe).final
        imgs.append(decode_images(family, final, ps))
        if soundtracks is not None and getattr(family, "audio", False):
            waves, rate = family.decode_audio(final)
            soundtracks.extend((w, rate) for w in waves)
    return np.concatenate(imgs)


def prompt_encodings(family, prompts: list[str], recipe: SamplerRecipe, batch: int = 64,
                     images: list[bytes] | None = None) -> dict:
    """What `generate_images` encodes for these prompts (with their source images, an editing
    family's) — each generation batch's conditioning and its negative prompt's — in host memory,
    for a process that holds no text towers."""
    enc = lambda s: family.encode_prompts(prompts[s:s + batch], *([images[s:s + batch]] if images else []))  # noqa: E731
    negs = _negatives(family, recipe, len(prompts), batch, images)
    return {"batches": [conditioning_to(enc(s), "cpu") for s in range(0, len(prompts), batch)],
            "negatives": [None if n is None else conditioning_to(n, "cpu") for n in negs]}


def _negatives(family, recipe: SamplerRecipe, n: int, batch: int, images: list[bytes] | None) -> list:
    """Each generation batch's negative conditioning (None without one): the recipe's negative
    prompt as the family encodes it — with each row's source image where the family's pipeline
    encodes it so (`negative_reads_images`)."""
    text = negative_prompt_of(family, recipe)
    starts = range(0, n, batch)
    if text is None:
        return [None for _ in starts]
    if getattr(family, "negative_reads_images", False) and images:  # (text-to-image: one negative for all)
        return [family.encode_prompts([text] * len(images[s:s + batch]), images[s:s + batch]) for s in starts]
    neg = family.encode_negative(text)
    return [neg.expand(min(batch, n - s)) for s in starts]


def judge_images(pairs: list[tuple[dict, int]], imgs: np.ndarray) -> dict:
    """The metrics of an evaluation from its (prompt, seed) pairs and their images, in order."""
    per: dict[str, list[float]] = {}
    partial: list[float] = []
    for (p, _), img in zip(pairs, imgs):
        frames = img if img.ndim == 4 else img[None]  # a clip is judged frame by frame, then averaged
        rs = [judge(f, p) for f in frames]
        per.setdefault(p["category"], []).append(float(np.mean([r["correct"] for r in rs])))
        partial.append(float(np.mean([r["partial"] for r in rs])))
    cats = {k: float(np.mean(v)) for k, v in per.items()}
    lo, hi = bootstrap_interval(per)
    return {"accuracy": float(np.mean(list(cats.values()))), "accuracy_ci_low": lo, "accuracy_ci_high": hi,
            "sample_accuracy": float(np.mean([x for v in per.values() for x in v])),
            "partial": float(np.mean(partial)), "n": len(pairs), **cats}


def evaluation_pairs(items, per_category: int) -> list[tuple[dict, int]]:
    """eval_set, refusing a prompt set with nothing of the shapes categories to evaluate."""
    pairs = eval_set(items, per_category)
    if not pairs:
        raise ValueError("the prompt set has no prompts of the shapes categories to evaluate")
    return pairs


def evaluate(family, items, recipe: SamplerRecipe | TokenRecipe, per_category: int = 48) -> dict:
    """Accuracy of `family` on prompt `items` (a split's PromptItems), `per_category` samples each."""
    pairs = evaluation_pairs(items, per_category)
    imgs = generate_images(family, [p["prompt"] for p, _ in pairs], [s for _, s in pairs], recipe)
    return judge_images(pairs, imgs)


class ShapesEvaluator:
    """The registered shapes evaluator: the shared deterministic ODE recipe of `sampling` (a token
    family: its sampling transform) on the split's prompt items. In three parts, so an engine
    with several rollout workers can generate the images in shards of whole generation batches
    (`batch`: the same images as one process makes) and judge them together."""

    batch = 64  # generate_images' batch: shards start on its multiples

    def pairs(self, items, per_category: int) -> list[tuple[dict, int]]:
        return evaluation_pairs(items, per_category)

    def images(self, family, pairs: list[tuple[dict, int]], sampling, encoded: dict | None = None) -> np.ndarray:
        recipe = eval_recipe(sampling, family.semantics.step.value)
        return generate_images(family, [p["prompt"] for p, _ in pairs], [s for _, s in pairs], recipe, self.batch,
                               encoded)

    def encodings(self, family, pairs: list[tuple[dict, int]], sampling) -> dict | None:
        """The prompt encodings `images` makes for these pairs (None for a token family, whose
        prompts are its own ids): a rollout worker without text towers is given them."""
        recipe = eval_recipe(sampling, family.semantics.step.value)
        if isinstance(recipe, TokenRecipe):
            return None
        return prompt_encodings(family, [p["prompt"] for p, _ in pairs], recipe, self.batch)

    def aggregate(self, pairs: list[tuple[dict, int]], images: np.ndarray) -> dict:
        return judge_images(pairs, images)

    def __call__(self, family, items, sampling, per_category: int) -> dict:
        pairs = self.pairs(items, per_category)
        return self.aggregate(pairs, self.images(family, pairs, sampling))


evaluate_split = register_evaluator("shapes")(ShapesEvaluator())
