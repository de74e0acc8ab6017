"""The prompt-embedding cache, keyed by (text-encoder identity, hash of the encoded prompt set).

Generate and update of an iteration encode the same prompts; the second is a cache hit. The key
is the sorted *set* of prompts encoded as one batch, not each prompt alone, on purpose: a text
encoder's output for a row can differ in the last bits with the batch it ran in, and the
rollout's and the replay's conditioning must be bit-identical for the ratio to be exactly 1
(and resumed runs bit-identical to uninterrupted ones). Entries live on the model's device;
the cache keeps the most recent few sets, so memory stays bounded over a long run.

An editing family's prompts are condition keys (models/source_images.py): the prompt and its
source image's digest; `encode` is given the images' bytes with the keys (they are not kept:
an editing set's images would fill memory over a long run) and encodes each prompt with its image.

A process without text towers (a Ray trainer rank) replays with the encodings the rollout made:
`encodings` exports a cache's sets (and negative prompt) to host memory, `holding` builds a cache
of exactly those (on a miss its family refuses to encode, naming why).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from ..models.base import conditioning_to
from ..models.source_images import SEP, SourceImageError, image_bank, split_key


class PromptCache:
    def __init__(self, family, capacity: int = 4):
        self.family = family
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[object, dict[str, int]]] = OrderedDict()
        self._negatives: dict[str, object] = {}  # a run's negative prompt (one, in practice)
        self.hits = 0
        self.misses = 0

    def _key(self, prompts: list[str]) -> str:
        h = hashlib.sha256("\x1f".join(prompts).encode())
        return f"{self.family.identity()}:{h.hexdigest()}"

    @torch.no_grad()
    def encode(self, prompts: list[str], images=None):
        """(conditioning of the distinct prompts in sorted order, prompt → row) for `prompts`;
        `images`: the source images their condition keys name (an editing family; a cache hit
        needs none)."""
        uniq = sorted(set(prompts))
        key = self._key(uniq)
        if key in self._entries:
            self.hits += 1
            self._entries.move_to_end(key)
            return self._entries[key]
        self.misses += 1
        entry = (self._encode(uniq, image_bank(images)), {t: i for i, t in enumerate(uniq)})
        self._entries[key] = entry
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return entry

    def _encode(self, keys: list[str], bank: dict[str, bytes]):
        """The family's conditioning of condition keys: text alone, or each prompt with its image."""
        parts = [split_key(k) for k in keys]
        if not any(dig for _, dig in parts):
            return self.family.encode_prompts(keys)
        if not getattr(self.family, "takes_images", False):
            from ..models.registry import image_taking_families

            raise SourceImageError(f"the {self.family.name} family generates from text alone, and these prompts carry "
                                   f"source images (an editing dataset); use a family that takes them "
                                   f"({image_taking_families()}) or a dataset without images")
        lost = sorted({dig for _, dig in parts if dig and dig not in bank})
        if lost:
            raise RuntimeError(f"no source image with digest {lost[0]} was given with the prompts to encode")
        return self.family.encode_prompts([p for p, _ in parts], [bank[d] if d else None for _, d in parts])

    def _negative_key(self, text: str) -> str:
        return f"{self.family.identity()}:negative:{hashlib.sha256(text.encode()).hexdigest()}"

    @torch.no_grad()
    def negative(self, text: str):
        """Classifier-free guidance's negative prompt (`sampling.negative_prompt`, the recipe's),
        encoded once, as the family's pipeline encodes its negative (`Family.encode_negative`),
        and kept apart from prompt sets: a prompt with the same text may be encoded otherwise."""
        key = self._negative_key(text)
        if key in self._negatives:
            self.hits += 1
        else:
            self.misses += 1
            self._negatives[key] = self.family.encode_negative(text)
        return self._negatives[key]

    def negative_rows(self, text: str, keys: list[str], images=None) -> "NegativeRows":
        """The negative prompt's conditioning for rows of these condition keys: the one encoding of
        `text` — or, for a family whose pipeline encodes the negative prompt with each row's
        source image (`negative_reads_images`: Qwen-Image-Edit), the negative prompt with every
        distinct source of `keys`, encoded as a prompt set of its own (and cached as one)."""
        if not getattr(self.family, "negative_reads_images", False):
            return NegativeRows(self.negative(text))
        cond, pos = self.encode([negative_key(text, k) for k in keys], images)
        return NegativeRows(cond, pos, text)

    @torch.no_grad()
    def encodings(self, prompt_sets: list[list[str]], negative: str | None, images=None) -> dict:
        """The conditioning of each prompt set (and of the negative prompt, when sampling batches
        one), as this cache encodes them, in host memory: {"sets": [(the set's distinct prompts in
        sorted order, conditioning)], "negative": (text, conditioning) or None}. A negative prompt
        read with each row's image travels as further sets (its keys: the negative with each image)."""
        with_images = negative is not None and getattr(self.family, "negative_reads_images", False)
        keysets = [list(p) for p in prompt_sets]
        keysets += [[negative_key(negative, k) for k in p] for p in prompt_sets] if with_images else []
        sets = []
        for keys in keysets:
            cond, pos = self.encode(keys, images)
            sets.append((sorted(pos, key=pos.get), conditioning_to(cond, "cpu")))
        neg = None if negative is None or with_images else (negative, conditioning_to(self.negative(negative), "cpu"))
        return {"sets": sets, "negative": neg}

    @classmethod
    def holding(cls, family, encodings: dict) -> "PromptCache":
        """A cache holding exactly `encodings` (from `encodings` of another process), moved to the
        family's device: the sets it serves are bit for bit the ones the rollout encoded."""
        cache = cls(family, capacity=max(1, len(encodings["sets"])))
        for uniq, cond in encodings["sets"]:
            cache._entries[cache._key(uniq)] = (conditioning_to(cond, family.device), {t: i for i, t in enumerate(uniq)})
        if encodings["negative"] is not None:
            text, cond = encodings["negative"]
            cache._negatives[cache._negative_key(text)] = conditioning_to(cond, family.device)
        return cache


def negative_key(text: str, key: str) -> str:
    """The condition key of the negative prompt with the source image of the row key `key`."""
    _, dig = split_key(key)
    return text if dig is None else f"{text}{SEP}{dig}"


class NegativeRows:
    """CFG's negative conditioning of given rows (`of(keys)`): one encoding broadcast to them, or
    each row's own (the negative prompt with the row's source image)."""

    def __init__(self, cond, pos: dict[str, int] | None = None, text: str = ""):
        self.cond, self.pos, self.text = cond, pos, text

    def of(self, keys: list[str]):
        if self.pos is None:
            return self.cond.expand(len(keys))
        return self.cond.select([self.pos[negative_key(self.text, k)] for k in keys])
