"""Pref-GRPO's reward (Wang et al., arXiv 2508.20751; algorithms.md §6.2): each image's win rate
against the other images of its group, as a VLM judges every pair of them. A pointwise reward
model's tiny score gaps become full-size advantages once the group's std divides them ("illusory
advantage"), which drives reward hacking; a win rate moves only when the judge prefers one image.

For each pair (a, b) of a group the judge sees "Image 1:" a, "Image 2:" b and the question, and
its first answer token gives p(1) and p(2) (each answer's listed spellings summed; logits, no
sampling, so scores are deterministic). `decision=hard` counts a win for the likelier answer and
half a win each on a tie, as Pref-GRPO counts its judge's verdicts; `soft` credits
p(1)/(p(1)+p(2)). r_i = wins_i / comparisons_i. `both_orders` (default) also asks with the pair
swapped, so the judge's preference for a position cancels; Pref-GRPO asks each pair once, in
group order (`both_orders=false`). Every comparison hands out one win in total, so a group's
win rates average ½ and group normalisation works on their spread.

Deviations from Pref-GRPO's code (fastvideo/rewards/unifiedreward_think.py): its judge
(UnifiedReward-Think) reasons first and its final `<answer>` is parsed; here any Qwen2.5-VL /
Qwen3-VL instruct checkout (or a vLLM server of one) answers at once, read from its logits; win
rates are not rounded to three decimals unless `decimals=3`. Cost: G(G−1) comparisons per group with both orders
(G = 16: 240), `batch_size` pairs per forward — serve the judge with vLLM for real group sizes.
"""

from __future__ import annotations

from itertools import combinations

import numpy as np

from .base import ScoringError, register_reward
from .vlm_judge import VlmJudge

DEFAULT_QUESTION = ('Both images were generated for the caption "{prompt}". Which image matches the caption better? '
                    "Answer 1 or 2.")
CAPTIONS = ("Image 1:", "Image 2:")


@register_reward("pairwise_judge")
class PairwiseJudge(VlmJudge):
    groupwise = True
    ANSWERS = "first / .second"

    def __init__(self, path: str = "", question: str = DEFAULT_QUESTION, first: tuple[str, ...] = ("1",),
                 second: tuple[str, ...] = ("2",), decision: str = "hard", both_orders: bool = True,
                 batch_size: int = 4, dtype: str = "float32", backend: str = "transformers", url: str = "",
                 served_model: str = "", top_logprobs: int = 20, concurrency: int = 16, decimals: int | None = None):
        """`decimals`: round each win rate (Pref-GRPO rounds to 3); None keeps it exact."""
        if decision not in ("hard", "soft"):
            raise ValueError(f"reward {self.name}: decision {decision!r} is not one of hard, soft")
        self.question, self.batch_size, self.dtype = question, batch_size, dtype
        self.yes_words, self.no_words = tuple(first), tuple(second)
        self.decision, self.both_orders, self.decimals = decision, both_orders, decimals
        self.locate(path, backend, url, served_model, top_logprobs, concurrency)

    def pairs(self, groups: list[str], prompts: list[str]) -> list[tuple[int, int]]:
        """(image 1, image 2) of every comparison: each pair of a group once in group order, then,
        with both_orders, swapped."""
        members: dict[str, list[int]] = {}
        for i, g in enumerate(groups):
            members.setdefault(g, []).append(i)
        alone = [m[0] for m in members.values() if len(m) < 2]
        if alone:
            raise ScoringError(f"reward {self.name}: sample {alone[0]} (prompt {prompts[alone[0]]!r}) is alone in its "
                               f"group, with nothing to be compared with; it needs sampling.group_size ≥ 2 and whole "
                               f"groups in every scored batch")
        once = [pair for m in members.values() for pair in combinations(m, 2)]
        return once + [(b, a) for a, b in once] if self.both_orders else once

    def compare(self, images: np.ndarray, prompts: list[str], pairs: list[tuple[int, int]]):
        """(p(first), p(second)) of each comparison's answer."""
        texts = [self.question.format(prompt=prompts[a]) for a, _ in pairs]
        if self.backend == "vllm":
            requests = [self.vllm.chat_request([images[a], images[b]], t, CAPTIONS) for (a, b), t in zip(pairs, texts)]
            return self.vllm.ask(requests, self.yes_words, self.no_words,
                                 [f"samples {a} and {b} (prompt {prompts[a]!r})" for a, b in pairs])
        p1, p2 = [], []
        for s in range(0, len(pairs), self.batch_size):
            chunk = pairs[s:s + self.batch_size]
            inputs = self.chat_inputs([[images[a], images[b]] for a, b in chunk], texts[s:s + self.batch_size],
                                      CAPTIONS)
            one, two = self.first_token_probs(inputs, self.yes, self.no)
            p1.append(one)
            p2.append(two)
        return np.concatenate(p1), np.concatenate(p2)

    def outcomes(self, p1: np.ndarray, p2: np.ndarray, prompts: list[str], pairs) -> np.ndarray:
        """Image 1's share of each comparison's win."""
        p1, p2 = np.asarray(p1, np.float64), np.asarray(p2, np.float64)
        if self.decision == "hard":
            return np.where(p1 > p2, 1.0, np.where(p1 < p2, 0.0, 0.5))
        mass = p1 + p2
        if np.any(mass <= 1e-30):
            a, b = pairs[int(np.argmin(mass))]
            raise ScoringError(f"reward {self.name}: the judge put no probability on {self.yes_words} or "
                               f"{self.no_words} comparing samples {a} and {b} (prompt {prompts[a]!r}); ask a "
                               f"question those answer, or list the spellings it uses")
        return p1 / mass

    def score(self, images, prompts, metadata, groups=None):
        groups = groups if groups is not None else [f"prompt:{p}" for p in prompts]
        pairs = self.pairs(list(groups), list(prompts))
        p1, p2 = self.compare(images, list(prompts), pairs)
        won = self.outcomes(p1, p2, list(prompts), pairs)
        n = len(images)
        wins, count, mass = np.zeros(n), np.zeros(n), np.zeros(n)
        for (a, b), w, m in zip(pairs, won, np.asarray(p1, np.float64) + np.asarray(p2, np.float64)):
            wins[a] += w
            wins[b] += 1.0 - w
            count[a] += 1
            count[b] += 1
            mass[a] += m
            mass[b] += m
        rate = wins / count if self.decimals is None else np.round(wins / count, self.decimals)
        return {self.name: rate.astype(np.float32),
                f"{self.name}.p_answer": (mass / count).astype(np.float32),
                f"{self.name}.comparisons": count.astype(np.float32)}
