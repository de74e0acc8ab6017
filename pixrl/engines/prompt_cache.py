"""The prompt-embedding cache, keyed by (text-encoder identity, hash of the encoded prompt set).

Generate and update of an iteration encode the same prompts; the second is a cache hit. The key
is the sorted *set* of prompts encoded as one batch, not each prompt alone, on purpose: a text
encoder's output for a row can differ in the last bits with the batch it ran in, and the
rollout's and the replay's conditioning must be bit-identical for the ratio to be exactly 1
(and resumed runs bit-identical to uninterrupted ones). Entries live on the model's device;
the cache keeps the most recent few sets, so memory stays bounded over a long run.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch


class PromptCache:
    def __init__(self, family, capacity: int = 4):
        self.family = family
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[object, dict[str, int]]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def _key(self, prompts: list[str]) -> str:
        h = hashlib.sha256("\x1f".join(prompts).encode())
        return f"{self.family.identity()}:{h.hexdigest()}"

    @torch.no_grad()
    def encode(self, prompts: list[str]):
        """(conditioning of the distinct prompts in sorted order, prompt → row) for `prompts`."""
        uniq = sorted(set(prompts))
        key = self._key(uniq)
        if key in self._entries:
            self.hits += 1
            self._entries.move_to_end(key)
            return self._entries[key]
        self.misses += 1
        entry = (self.family.encode_prompts(uniq), {t: i for i, t in enumerate(uniq)})
        self._entries[key] = entry
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return entry

    def negative(self):
        """The empty prompt's conditioning (classifier-free guidance), encoded once."""
        cond, _ = self.encode([""])
        return cond
