"""A real CLIP BPE tokenizer (vocab.json + merges.txt) whose vocabulary is a closed word list.

The mini model must load through the same `CLIPTokenizer.from_pretrained` path as SD3.5, and
nothing may be downloaded, so the tokenizer files are written here: every single character
(so any ASCII text still tokenizes) plus merge chains that make each listed word one token.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import CLIPTokenizer

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789.,'-!"


def write_word_tokenizer(words: list[str], out_dir: Path, max_length: int) -> CLIPTokenizer:
    """Write vocab.json/merges.txt for `words`, load them with CLIPTokenizer and save it in the
    transformers layout under `out_dir`."""
    vocab: dict[str, int] = {}

    def add(tok: str) -> None:
        if tok not in vocab:
            vocab[tok] = len(vocab)

    for c in _CHARS:
        add(c)
    for c in _CHARS:
        add(c + "</w>")
    merges: list[str] = []
    for w in sorted(set(words), key=lambda s: (len(s), s)):
        pieces = list(w[:-1]) + [w[-1] + "</w>"]
        cur = pieces[0]
        for nxt in pieces[1:]:
            merges.append(f"{cur} {nxt}")
            cur = cur + nxt
            add(cur)
    add(BOS)
    add(EOS)
    raw = out_dir / "_raw"
    raw.mkdir(parents=True, exist_ok=True)
    (raw / "vocab.json").write_text(json.dumps(vocab))
    (raw / "merges.txt").write_text("#version: 0.2\n" + "\n".join(dict.fromkeys(merges)) + "\n")
    tok = CLIPTokenizer(vocab_file=str(raw / "vocab.json"), merges_file=str(raw / "merges.txt"),
                        bos_token=BOS, eos_token=EOS, pad_token=EOS, unk_token=EOS,
                        model_max_length=max_length)
    tok.save_pretrained(out_dir)
    for f in raw.iterdir():
        f.unlink()
    raw.rmdir()
    return CLIPTokenizer.from_pretrained(out_dir)
