"""A tiny HPSv3 in the released layout, for tests and for trying the reward without weights: a
Qwen2-VL-Instruct checkout (Qwen2VLConfig, the Qwen2 tokenizer with the vision tokens and Qwen2-VL's
chat template with its default system turn, Qwen2VLImageProcessor at Qwen2-VL's pixel bounds) and
HPSv3.safetensors — a random Qwen2VLForConditionalGeneration whose vocabulary holds `<|Reward|>`,
its keys in transformers 4.45's layout as HPSv3 saved them, and the reward head."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..models.tiny_parts import QWEN_VL_CHAT_TEMPLATE

#: Qwen2-VL-Instruct's chat format: Qwen-VL's turns of images and text after a default system turn
QWEN2_VL_CHAT_TEMPLATE = QWEN_VL_CHAT_TEMPLATE.replace(
    "{%- for message in messages -%}",
    "{%- for message in messages -%}{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}{%- endif -%}", 1).replace(
    "{%- elif part['type'] == 'text' -%}",
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}", 1)


def to_transformers445(key: str) -> str:
    """transformers 5's Qwen2-VL key as transformers 4.45 (and HPSv3's checkpoint) named it."""
    if key.startswith("model.visual."):
        return key[len("model."):]
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    return key


def qwen2_vl_tokenizer(out_dir: Path, text: str):
    """Qwen2-VL-Instruct's tokenizer in miniature: byte-level BPE whose words are those of `text`
    (the reward's instruction) and the tiny vocabulary, Qwen's special and vision tokens, and the
    chat template; saved to `out_dir`."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    from ..models.tiny_parts import tiny_vocabulary, whole_word_merges

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    pieces = {p for p, _ in ByteLevel(add_prefix_space=False).pre_tokenize_str(text + " system user")}
    pieces |= {"Ġ" + w for w in tiny_vocabulary()}
    tok = Qwen2Tokenizer(vocab=vocab, merges=whole_word_merges(vocab, sorted(p for p in pieces if len(p) > 1)))
    tok.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
                            "additional_special_tokens": ["<|im_start|>", "<|vision_start|>", "<|vision_end|>",
                                                          "<|image_pad|>", "<|video_pad|>"]})
    tok.chat_template = QWEN2_VL_CHAT_TEMPLATE
    tok.save_pretrained(str(out_dir))
    return tok


def tiny_config(tok, hidden: int = 32):
    """A two-layer Qwen2-VL (its vision tower: 14-px patches, 2×2 merge, one block)."""
    from transformers import Qwen2VLConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>")}
    special = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id, "bos_token_id": tok.pad_token_id}
    heads = 2
    half = hidden // heads // 2
    sections = [half * 2 // 8, half * 3 // 8, half - half * 2 // 8 - half * 3 // 8]
    return Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=4096, **special,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": sections}),
        vision_config=dict(depth=1, embed_dim=hidden, hidden_size=hidden, mlp_ratio=2, num_heads=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], **special)


def write_tiny_hpsv3(out_dir: Path, hidden: int = 32, seed: int = 0) -> tuple[Path, Path]:
    """(HPSv3.safetensors, the base checkout) under `out_dir`."""
    from safetensors.torch import save_file
    from transformers import Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from .hpsv3 import ASK, INSTRUCTION, REWARD_TOKEN

    out_dir = Path(out_dir)
    base = out_dir / "Qwen2-VL-Instruct-tiny"
    base.mkdir(parents=True, exist_ok=True)
    tok = qwen2_vl_tokenizer(base, INSTRUCTION + ASK)
    cfg = tiny_config(tok, hidden)
    cfg.save_pretrained(str(base))
    Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056).save_pretrained(str(base))  # Qwen2-VL's bounds
    tok.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    cfg.text_config.vocab_size = len(tok)  # as HPSv3 resized its embeddings for the reward token
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg)
    head = nn.Sequential(nn.Linear(hidden, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(),
                         nn.Linear(16, 2))
    state = {to_transformers445(k): v.contiguous() for k, v in model.state_dict().items()}
    state.update({f"rm_head.{k}": v.contiguous() for k, v in head.state_dict().items()})
    save_file(state, str(out_dir / "HPSv3.safetensors"))
    return out_dir / "HPSv3.safetensors", base
