"""Janus-Pro's semantic chain of thought (T2I-R1's BiCoT): the fixed token ids around a sampled
thought, and the prompt set's layout of them. The family (models/janus.py) samples the thought
and builds the image prompts from these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .janus import JanusPrompts


def user_turn(prompt: str) -> str:
    """A user turn with the generation prompt, as Janus-Pro's chat template renders it."""
    return f"<|User|>: {prompt.strip()}\n\n<|Assistant|>:"


@dataclass
class CotPrompts:
    """A prompt set's semantic chain of thought (T2I-R1's BiCoT): the reasoning prompts the text
    is sampled from (left-padded to the set's width), and per prompt the ids that wrap the CoT in
    the image prompt `<|User|>: {prompt}. {cot}\n\n<|Assistant|>:<begin_of_image>`. The image
    prompts are padded to one width for the whole set (longest head + tail + the CoT budget), so
    a row's conditioning never depends on the batch it is replayed in."""

    text: "JanusPrompts"  # the reasoning prompts (no unconditional rows: text is sampled unguided)
    heads: list[list[int]]  # BOS + "<|User|>: {prompt}. " per prompt of the set
    tail: list[int]  # "\n\n<|Assistant|>:" + <begin_of_image>
    width: int


def cot_parts(tokenizer, prompt: str, template: str) -> tuple[list[int], list[int]]:
    """A chain of thought's fixed ids for one prompt (T2I-R1's layout): the reasoning prompt — a
    user turn of `template` with the prompt and the generation prompt — and the image prompt's head
    `<|User|>: {prompt}. ` (BOS first), before the thought."""
    reasoning = tokenizer(user_turn(template.format(prompt=prompt.strip()))).input_ids
    return reasoning, tokenizer(f"<|User|>: {prompt.strip()}. ").input_ids


def cot_tail(tokenizer) -> list[int]:
    """The image prompt's ids after the thought: `\n\n<|Assistant|>:<begin_of_image>`."""
    return (tokenizer("\n\n<|Assistant|>:", add_special_tokens=False).input_ids
            + [tokenizer.convert_tokens_to_ids(tokenizer.boi_token)])


def cot_length(reasoning: list[int], head: list[int], tail: list[int], budget: int) -> int:
    """The longer of the two sequences a chain of thought of `budget` tokens can make."""
    return max(len(reasoning) + budget, len(head) + budget + len(tail))
