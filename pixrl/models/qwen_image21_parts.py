"""Tiny random parts of Qwen-Image-2.1 (`pixrl tiny qwen_image21`): a Qwen3-VL text encoder (its
language model with interleaved M-RoPE and a one-block vision tower of 16-px patches), Qwen's
byte-level tokenizer with the chat and vision tokens, the processor's files, the 16× RGBA VAE with
its latent mean/std, the single-stream DiT and the dynamic-shift scheduler — saved as the release
lays them out (`processor/` declared as Qwen3VLProcessor in model_index.json)."""

from __future__ import annotations

from pathlib import Path

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def qwen3_vl_text_encoder(tok, hidden: int = 32, layers: int = 2):
    """A tiny Qwen3VLForConditionalGeneration (tied embeddings, as the 2B–8B Qwen3-VL ship)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    heads = 2
    half = hidden // heads // 2
    sections = [half * 2 // 8, half * 3 // 8, half - half * 2 // 8 - half * 3 // 8]
    special = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id, "bos_token_id": tok.eos_token_id}
    cfg = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=1, head_dim=hidden // heads,
                         max_position_embeddings=4096, **special,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": sections,
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=2, out_hidden_size=hidden,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0],
                           num_position_embeddings=64),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True)
    return Qwen3VLForConditionalGeneration(cfg)


def tiny_parts(build: Path, hidden: int = 32) -> dict:
    """The components of a tiny QwenImage21Pipeline."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel
    from transformers import Qwen2VLImageProcessorPil

    from .qwen_vl_processor import QwenVLProcessor
    from .tiny_parts import QWEN_VL_CHAT_TEMPLATE, qwen2_tokenizer

    tok = qwen2_tokenizer(build / "tokenizer", extra_pieces=["Comprehend", "Ġanalyze", "Ġprovided"])
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = QWEN_VL_CHAT_TEMPLATE
    # bounds that keep a source of up to 2048² at its size: its grid must be the VAE's, slot for slot
    images = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, min_pixels=32 * 32, max_pixels=2048 * 2048)
    vae = AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 1, 2, 2, 2], num_res_blocks=1,
                                   temperal_downsample=[False] * 4, latents_mean=[0.1, -0.2, 0.05, 0.0],
                                   latents_std=[1.5, 2.0, 1.2, 1.8])  # 4 downsamples: 16×, as released
    transformer = QwenImage21Transformer2DModel(in_channels=4, out_channels=4, num_layers=1, attention_head_dim=16,
                                                num_attention_heads=2, context_in_dim=hidden, axes_dims_rope=(4, 6, 6))
    sched = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                            base_image_seq_len=256, max_image_seq_len=8192, time_shift_type="exponential")
    return {"scheduler": sched, "vae": vae, "text_encoder": qwen3_vl_text_encoder(tok, hidden),
            "processor": QwenVLProcessor(images, tok), "transformer": transformer}


def save_pipeline(parts: dict, out_dir: Path) -> None:
    """A QwenImage21Pipeline in the released layout: the processor's files in `processor/`,
    declared as transformers' Qwen3VLProcessor in model_index.json."""
    import json

    from diffusers import QwenImage21Pipeline

    QwenImage21Pipeline(**parts).save_pretrained(str(out_dir), safe_serialization=True)
    parts["processor"].save_pretrained(out_dir / "processor")
    index = json.loads((out_dir / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen3VLProcessor"]
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
