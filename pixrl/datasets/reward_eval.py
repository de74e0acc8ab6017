"""Held-out evaluation of a prompt set that has no evaluator of its own (a text prompt file,
GenEval metadata scored by a served GenEval, an editing set): the run's own rewards on the split's
prompts at fixed seeds with the eval sampler — what flow_grpo reports as its test-set reward
(the reward functions over the test prompts every eval_freq epochs).

Per category (the prompts' metadata `category`; one category when they carry none), the split's
prompts are cycled in file order up to `per_category` samples, with seeds that depend only on the
category and the sample's index, so every evaluation of a run — and of every run on the same
set — judges the same (prompt, seed) pairs. `accuracy`, the headline every evaluator returns, is
here the mean total reward over categories; the per-category and per-component means beside it.
An editing set's samples edit their own source images; a sounding family's clips are scored with
their soundtracks (`SoundingClips`), as rollouts are."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..algorithms.recipe import eval_recipe
from .prompts import PromptItem
from .shapes.evaluate import EVAL_SEED, generate_images, prompt_encodings  # EVAL_SEED: the shapes evaluator's seeds


def reward_eval_pairs(items: list[PromptItem], per_category: int) -> list[tuple[PromptItem, int]]:
    """(prompt item, seed) pairs: per category in sorted order, its prompts cycled in file order."""
    cats = sorted({it.meta.get("category", "") for it in items})
    out = []
    for ci, cat in enumerate(cats):
        ps = [it for it in items if it.meta.get("category", "") == cat]
        out += [(ps[i % len(ps)], EVAL_SEED * 1000 + ci * 100_000 + i) for i in range(per_category)]
    return out


@dataclass
class SoundingClips:
    """Clips [N, F, H, W, 3] with each one's soundtrack as the rows store it (16-bit WAV): what a
    family whose clips have sound (`audio`) makes for an evaluation."""

    frames: np.ndarray
    soundtracks: list[bytes]


def join_samples(parts: list):
    """The shards of an evaluation's samples (image arrays, or SoundingClips) in order, as one."""
    if parts and isinstance(parts[0], SoundingClips):
        return SoundingClips(np.concatenate([p.frames for p in parts]), [s for p in parts for s in p.soundtracks])
    return np.concatenate(parts)


class RewardEvaluator:
    """The run's rewards as an evaluator, in the shapes evaluator's three parts — pairs, images
    (shardable over rollout workers in whole generation batches of `batch`: the images one process
    makes), and an aggregate that scores them with `score(images, prompts, metadata, sample_ids)`:
    a RewardSet's, or on Ray the engine's (its reward workers). Unscored parts need no `score`."""

    batch = 64

    def __init__(self, score=None):
        self.score = score

    def pairs(self, items: list[PromptItem], per_category: int) -> list[tuple[PromptItem, int]]:
        return reward_eval_pairs(items, per_category)

    def images(self, family, pairs, sampling, encoded: dict | None = None):
        """The pairs' images (clips), or SoundingClips for a family whose clips have sound."""
        from ..artifacts.media import wav_bytes

        recipe = eval_recipe(sampling, family.semantics.step.value)
        sounds: list | None = [] if getattr(family, "audio", False) else None
        imgs = generate_images(family, [it.prompt for it, _ in pairs], [s for _, s in pairs], recipe, self.batch,
                               encoded, images=_sources(pairs), soundtracks=sounds)
        return imgs if sounds is None else SoundingClips(imgs, [wav_bytes(w, rate) for w, rate in sounds])

    def encodings(self, family, pairs, sampling) -> dict | None:
        """The prompt (and source image) encodings `images` makes, for a worker without text towers."""
        from ..algorithms.token_sampling import TokenRecipe

        recipe = eval_recipe(sampling, family.semantics.step.value)
        if isinstance(recipe, TokenRecipe):
            return None
        return prompt_encodings(family, [it.prompt for it, _ in pairs], recipe, self.batch, images=_sources(pairs))

    def aggregate(self, pairs, images) -> dict:
        """The images (SoundingClips) scored, summarised: mean total reward per category and over
        categories (`accuracy`), each component's mean, the sample count."""
        metas = [{**it.meta, **({"source_image": it.image} if it.image is not None else {})} for it, _ in pairs]
        if isinstance(images, SoundingClips):
            metas = [{**m, "soundtrack": s} for m, s in zip(metas, images.soundtracks)]
            images = images.frames
        scores = self.score(images, [it.prompt for it, _ in pairs], metas, [f"eval-{it.prompt_id}-{s}" for it, s in pairs])
        cats = [it.meta.get("category", "") for it, _ in pairs]
        total = np.asarray(scores["reward"], np.float64)
        per_cat = {c or "all": float(total[[k == c for k in cats]].mean()) for c in sorted(set(cats))}
        out = {"accuracy": float(np.mean(list(per_cat.values()))), "n": len(pairs), "metric": "reward",
               **{f"reward/{k}": float(np.nanmean(v)) for k, v in scores.items()  # per-task: its samples
                  if k != "reward" and not np.all(np.isnan(v))}}
        if len(per_cat) > 1:
            out.update({f"category/{c}": v for c, v in per_cat.items()})
        return out

    def __call__(self, family, items: list[PromptItem], sampling, per_category: int) -> dict:
        pairs = self.pairs(items, per_category)
        return self.aggregate(pairs, self.images(family, pairs, sampling))


def _sources(pairs) -> list[bytes] | None:
    """The pairs' source images (an editing set), or None when they have none."""
    sources = [it.image for it, _ in pairs]
    return sources if any(im is not None for im in sources) else None


def reward_evaluation(family, items: list[PromptItem], sampling, per_category: int, rewards) -> dict:
    """The run's rewards (`rewards`: a RewardSet) on the split (RewardEvaluator, in one process)."""
    return RewardEvaluator(rewards.score)(family, items, sampling, per_category)
