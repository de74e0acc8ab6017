"""A real CLIP BPE tokenizer (vocab + BPE merges) whose vocabulary is a closed word list.

The mini model must load through the same `CLIPTokenizer.from_pretrained` path as SD3.5, and
nothing may be downloaded, so the tokenizer files are written here: every single character
(so any ASCII text still tokenizes) plus BPE merges that make each listed word one token.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from transformers import CLIPTokenizer

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789.,'-!"


def _train_merges(words: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Learn BPE merges on the word list itself, so that applying them in rank order turns every
    listed word into one token (hand-written merge chains collide: 're' from 'red' splits 'three').

    Written out rather than taken from `tokenizers.BpeTrainer`, whose ties between equally frequent
    pairs (and ids of word-final characters) follow a per-process hash order: two pretraining runs
    with the same seed got different token ids. Here ties go to the alphabetically first pair."""
    seqs = [list(w[:-1]) + [w[-1] + "</w>"] for w in words]
    merges: list[tuple[str, str]] = []
    while True:
        counts = Counter(pair for seq in seqs for pair in zip(seq, seq[1:]))
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        seqs = [_merge(seq, best) for seq in seqs]
    chars = list(_CHARS) + [c + "</w>" for c in _CHARS]
    vocab: dict[str, int] = {}
    for t in [BOS, EOS, *chars, *("".join(m) for m in merges)]:
        vocab.setdefault(t, len(vocab))
    return vocab, merges


def _merge(seq: list[str], pair: tuple[str, str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(seq):
        if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
            out.append(seq[i] + seq[i + 1])
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out


def write_word_tokenizer(words: list[str], out_dir: Path, max_length: int) -> CLIPTokenizer:
    """Write a CLIPTokenizer for `words` in the transformers layout under `out_dir`."""
    vocab, merges = _train_merges(sorted(set(words)))
    tok = CLIPTokenizer(vocab=vocab, merges=merges, bos_token=BOS, eos_token=EOS,
                        pad_token=EOS, unk_token=EOS, model_max_length=max_length)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out_dir)
    return CLIPTokenizer.from_pretrained(out_dir)
