"""A real CLIP BPE tokenizer (vocab + BPE merges) whose vocabulary is a closed word list.

The mini model must load through the same `CLIPTokenizer.from_pretrained` path as SD3.5, and
nothing may be downloaded, so the tokenizer files are written here: every single character
(so any ASCII text still tokenizes) plus BPE merges that make each listed word one token.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import CLIPTokenizer

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789.,'-!"


def _train_merges(words: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Learn BPE merges on the word list itself, so that applying them in rank order turns every
    listed word into one token (hand-written merge chains collide: 're' from 'red' splits 'three')."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=4096, min_frequency=1, show_progress=False,
                                  initial_alphabet=list(_CHARS), end_of_word_suffix="</w>",
                                  special_tokens=[BOS, EOS])
    tk.train_from_iterator([" ".join(words)] * 4, trainer=trainer)
    state = json.loads(tk.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    vocab = dict(state["vocab"])
    for c in _CHARS:  # every character, alone and word-final, so any ASCII text tokenizes
        for t in (c, c + "</w>"):
            vocab.setdefault(t, len(vocab))
    return vocab, merges


def write_word_tokenizer(words: list[str], out_dir: Path, max_length: int) -> CLIPTokenizer:
    """Write a CLIPTokenizer for `words` in the transformers layout under `out_dir`."""
    vocab, merges = _train_merges(sorted(set(words)))
    tok = CLIPTokenizer(vocab=vocab, merges=merges, bos_token=BOS, eos_token=EOS,
                        pad_token=EOS, unk_token=EOS, model_max_length=max_length)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out_dir)
    return CLIPTokenizer.from_pretrained(out_dir)
