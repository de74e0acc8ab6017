"""Tiny random parts of the Qwen-Image pipelines (`pixrl tiny qwen_image`, `qwen_image_edit[_plus]`): the
MMDiT, the causal VAE with its latent mean/std, the dynamic-shift scheduler, and for editing the
Qwen2.5-VL text encoder with its vision tokens and the Qwen2VLProcessor's files."""

from __future__ import annotations

from pathlib import Path

#: Qwen-Image-Edit's system prompt, whose words (each one token, as in Qwen's vocabulary) make the
#: 64 template tokens the pipeline drops
EDIT_SYSTEM = ("Describe the key features of the input image (color, shape, size, texture, objects, background), "
               "then explain how the user's text instruction should alter or modify the image. Generate a new image "
               "that meets the user's requirements while maintaining consistency with the original input where "
               "appropriate.")
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def qwen_image_core(z: int = 4, downsamples: int = 1, zero_cond_t: bool = False):
    """(VAE, transformer, scheduler) of a tiny Qwen-Image; the VAE downsamples 2^`downsamples`×
    (the released one 8×: editing's 1024² sources are then 4096 tokens, as at full size);
    `zero_cond_t`: Qwen-Image-Edit-2511's source tokens modulated at timestep 0."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=z, dim_mult=[1] + [2] * downsamples, num_res_blocks=1,
                                 temperal_downsample=[False] * downsamples,
                                 latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 2.0, 1.2, 1.8])
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=4 * z, out_channels=z, num_layers=1,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                              axes_dims_rope=(4, 6, 6), zero_cond_t=zero_cond_t)
    sched = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                            base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                            time_shift_type="exponential")
    return vae, transformer, sched


def edit_tokenizer(build: Path):
    """Qwen2's byte-level tokenizer with the edit template's words whole and the vision tokens."""
    from transformers import Qwen2Tokenizer

    from .tiny_parts import qwen2_tokenizer

    tok = qwen2_tokenizer(build / "plain")
    pieces = [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(f"system\n{EDIT_SYSTEM}\nuser\n")]
    # " user" as one token although "user" (the chat role) is merged whole first, as in Qwen's vocabulary
    tok = qwen2_tokenizer(build / "words", extra_pieces=[p for p in pieces if len(p) > 1], extra_pairs=[("Ġ", "user")])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]})
    tok.save_pretrained(str(build / "tokenizer"))
    return Qwen2Tokenizer.from_pretrained(str(build / "tokenizer"))


def save_edit_pipeline(parts: dict, out_dir: Path, pipeline: str = "QwenImageEditPipeline") -> None:
    """A QwenImageEdit(Plus)Pipeline in the released layout: its processor's files in `processor/`,
    declared as transformers' Qwen2VLProcessor in model_index.json."""
    import json

    import diffusers

    getattr(diffusers, pipeline)(**{**parts, "processor": None}).save_pretrained(str(out_dir), safe_serialization=True)
    parts["processor"].save_pretrained(out_dir / "processor")
    index = json.loads((out_dir / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def tiny_edit_parts(build: Path, hidden: int = 32, zero_cond_t: bool = False) -> dict:
    """The components of a tiny QwenImageEdit(Plus)Pipeline."""
    from transformers import Qwen2VLImageProcessorPil

    from .qwen_vl_processor import QwenVLProcessor
    from .tiny_parts import qwen25_vl_text_encoder

    tok = edit_tokenizer(build)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text_encoder = qwen25_vl_text_encoder(tok, hidden=hidden, image_token_id=ids["<|image_pad|>"],
                                          video_token_id=ids["<|video_pad|>"],
                                          vision_start_token_id=ids["<|vision_start|>"])
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56 * 4)  # a small pixel budget
    processor = QwenVLProcessor(images, tok)
    vae, transformer, sched = qwen_image_core(downsamples=3, zero_cond_t=zero_cond_t)
    return {"scheduler": sched, "vae": vae, "text_encoder": text_encoder, "tokenizer": tok, "processor": processor,
            "transformer": transformer}
