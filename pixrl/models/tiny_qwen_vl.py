"""A tiny Qwen2.5-VL-Instruct in the Hub layout, for the rewards that read one (vlm_judge,
pairwise_judge, editreward): its config and a whole checkout, built from tiny_parts' tokenizer
pieces and chat template."""

from __future__ import annotations

from pathlib import Path

from .tiny_parts import QWEN_VL_CHAT_TEMPLATE, tiny_vocabulary, whole_word_merges


def tiny_qwen25_vl_config(tok, hidden: int = 32, positions: int = 1024):
    """A two-layer Qwen2.5-VL (its vision tower: 14-px patches, 2×2 merge, one full-attention block)."""
    from transformers import Qwen2_5_VLConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>")}
    special = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id, "bos_token_id": tok.pad_token_id}
    heads = 2
    half = hidden // heads // 2
    sections = [half * 2 // 8, half * 3 // 8, half - half * 2 // 8 - half * 3 // 8]
    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=positions, **special,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": sections}),
        vision_config=dict(depth=1, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=2,
                           out_hidden_size=hidden, fullatt_block_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], **special)


def write_tiny_qwen25_vl(out_dir: Path, hidden: int = 32, seed: int = 0) -> Path:
    """A tiny Qwen2.5-VL-Instruct checkout in the Hub layout: Qwen2_5_VLForConditionalGeneration
    (its vision tower: 14-px patches, 2×2 merge), the Qwen2 tokenizer with the vision tokens and
    the chat template, and Qwen2VLImageProcessor's preprocessor_config.json with a small pixel
    budget (a 56² image → 4 image tokens). Words "Yes"/"No" are whole tokens, as in Qwen's vocabulary."""
    import torch
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer, Qwen2VLImageProcessor

    out_dir = Path(out_dir)
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    merges = whole_word_merges(vocab, ["Ġ" + w for w in tiny_vocabulary()] + ["Yes", "No", "yes", "no", "user",
                                                                             "assistant", "Does", "Answer"])
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
                            "additional_special_tokens": ["<|im_start|>", "<|vision_start|>", "<|vision_end|>",
                                                          "<|image_pad|>", "<|video_pad|>"]})
    tok.chat_template = QWEN_VL_CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    cfg = tiny_qwen25_vl_config(tok, hidden)
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(str(out_dir))
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56 * 4).save_pretrained(str(out_dir))
    return out_dir
