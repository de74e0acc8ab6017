"""Builds a miniature SD3 pipeline from the real diffusers/transformers classes.

The result is saved with `StableDiffusion3Pipeline.save_pretrained`, so it is loaded by the
same `SD3Family.load` path as SD3.5. Used for the shapes-world model (then pretrained) and
for the tiny random checkpoints the tests build.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...datasets.shapes.scene import COLORS, NUMBER_WORDS, SHAPES
from .tokenizer import write_word_tokenizer


def shapes_vocabulary() -> list[str]:
    words = {"a", "an", "and", "to", "the", "of", "left", "right", "above", "below"}
    words |= set(COLORS) | set(NUMBER_WORDS.values()) | set(SHAPES) | {s + "s" for s in SHAPES}
    return sorted(words)


@dataclass
class MiniSpec:
    """Sizes of the miniature. Defaults: the shapes-world model (32×32 px → 8×8×4 latents)."""

    image_size: int = 32
    vae_channels: tuple[int, ...] = (16, 32, 64)  # 3 blocks → ×4 downsampling; thin at full resolution
    latent_channels: int = 4
    text_hidden: int = 64  # per CLIP encoder; joint_attention_dim = 2 × text_hidden
    text_layers: int = 4
    text_max_length: int = 16
    num_layers: int = 6  # with 4 blocks and 32-wide text encoders, colour binding stayed at 0.3
    heads: int = 4
    head_dim: int = 32
    patch_size: int = 1
    shift: float = 3.0

    @property
    def latent_size(self) -> int:
        return self.image_size // 2 ** (len(self.vae_channels) - 1)


def build_pipeline(spec: MiniSpec, seed: int, workdir: Path):
    """Random-initialised StableDiffusion3Pipeline (text_encoder_3 = None) with a word tokenizer."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    tok = write_word_tokenizer(shapes_vocabulary(), workdir / "tokenizer", spec.text_max_length)
    text_cfg = CLIPTextConfig(
        vocab_size=len(tok), hidden_size=spec.text_hidden, intermediate_size=2 * spec.text_hidden,
        num_hidden_layers=spec.text_layers, num_attention_heads=2, projection_dim=spec.text_hidden,
        max_position_embeddings=spec.text_max_length, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    te1 = CLIPTextModelWithProjection(text_cfg)
    te2 = CLIPTextModelWithProjection(text_cfg)
    inner = spec.heads * spec.head_dim
    transformer = SD3Transformer2DModel(
        sample_size=spec.latent_size, patch_size=spec.patch_size, in_channels=spec.latent_channels,
        out_channels=spec.latent_channels, num_layers=spec.num_layers, attention_head_dim=spec.head_dim,
        num_attention_heads=spec.heads, joint_attention_dim=2 * spec.text_hidden,
        caption_projection_dim=inner, pooled_projection_dim=2 * spec.text_hidden,
        pos_embed_max_size=spec.latent_size // spec.patch_size)
    n = len(spec.vae_channels)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=spec.vae_channels,
        layers_per_block=1, latent_channels=spec.latent_channels, norm_num_groups=8,
        sample_size=spec.image_size, scaling_factor=1.0, shift_factor=0.0,
        use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=spec.shift)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=te1, tokenizer=tok,
        text_encoder_2=te2, tokenizer_2=tok, text_encoder_3=None, tokenizer_3=None)


def save_pipeline(pipe, out_dir: Path, spec: MiniSpec | None = None) -> Path:
    """Save in the diffusers layout (safetensors), plus the spec for provenance."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(out_dir), safe_serialization=True)
    if spec is not None:
        (out_dir / "pixrl_mini_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return out_dir


def build_random_checkpoint(out_dir: Path, spec: MiniSpec | None = None, seed: int = 0) -> Path:
    """A tiny random SD3 checkpoint on disk in the diffusers layout (tests, smoke runs)."""
    spec = spec or MiniSpec()
    pipe = build_pipeline(spec, seed, out_dir.parent / (out_dir.name + "_build"))
    return save_pipeline(pipe, out_dir, spec)
