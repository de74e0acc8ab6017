"""Seeded tiny LTX-2 components in the real diffusers layout (`pixrl tiny ltx2`): a Gemma-3
text encoder (with its SigLIP tower, as Gemma3ForConditionalGeneration ships), the text
connectors, the video VAE, the audio VAE and vocoder, the audio-video DiT and LTX-2's
flow-matching scheduler — at tiny widths, with the video and audio tokens both 8 features wide
(LTX-2's are both 128: 128 video latent channels; 8 audio channels × 16 latent mel bins).

`variant="2.3"` (the default) builds LTX-2.3's layout: per-modality text projections in the
connectors (no caption projection in the DiT), gated attention, prompt cross-attention
modulation and the perturbable self-attention that spatio-temporal guidance needs;
`variant="2.0"` builds LTX-2.0's (one shared projection, the DiT's caption projections)."""

from __future__ import annotations

from pathlib import Path

import torch

VIDEO_CHANNELS = 8  # tiny VAE latent channels (LTX-2: 128)
AUDIO_CHANNELS, MEL_BINS = 2, 16  # tiny audio latent channels and mel bins (LTX-2: 8 and 64; ×4 mel compression)


def gemma3_text_encoder(tokenizer, hidden: int = 32, layers: int = 2, heads: int = 2, kv_heads: int = 1,
                        head_dim: int | None = None, intermediate: int | None = None):
    """A Gemma3ForConditionalGeneration (the LTX-2 text encoder class) of the given widths — tiny
    by default — whose special ids match `tokenizer`; its vision tower is built tiny and never
    read (prompts are text)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    n, head_dim = len(tokenizer), head_dim or hidden // heads
    text = Gemma3TextConfig(vocab_size=n, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                            head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=64,
                            max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    return Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                       image_token_index=n - 1, boi_token_index=n - 2,
                                                       eoi_token_index=n - 3))


def ltx2_scheduler():
    """LTX-2's flow-matching Euler scheduler: the shift μ from the clip's video tokens between
    1024 (0.95) and 4096 (2.05), the grid stretched to end at 0.1."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(base_image_seq_len=1024, base_shift=0.95, max_image_seq_len=4096,
                                           max_shift=2.05, shift=1.0, shift_terminal=0.1, use_dynamic_shifting=True)


def tiny_parts(build: Path, seed: int, variant: str = "2.3") -> dict:
    """The LTX2Pipeline components (see the module docstring)."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder

    from .tiny_parts import gemma_tokenizer

    if variant not in ("2.0", "2.3"):
        raise ValueError(f"variant={variant!r}: the tiny LTX-2 is built as '2.0' or '2.3'")
    v23 = variant == "2.3"
    torch.manual_seed(seed)
    width, layers = 16, 2  # the DiT's (and connectors') inner width; Gemma's depth
    hidden = 32 if v23 else width  # Gemma's width (LTX-2.0 connectors work at it: Gemma-3-12B's 3840)
    tok = gemma_tokenizer(build / "tokenizer")
    text_encoder = gemma3_text_encoder(tok, hidden, layers)
    heads = dict(video_connector_num_attention_heads=2, video_connector_attention_head_dim=width // 2,
                 audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=width // 2,
                 video_connector_num_layers=1, audio_connector_num_layers=1,
                 video_connector_num_learnable_registers=8, audio_connector_num_learnable_registers=8)
    extra = dict(video_gated_attn=True, audio_gated_attn=True, per_modality_projections=True,
                 video_hidden_dim=width, audio_hidden_dim=width) if v23 else {}
    connectors = LTX2TextConnectors(caption_channels=hidden, text_proj_in_factor=layers + 1, **heads, **extra)
    vae = AutoencoderKLLTX2Video(
        latent_channels=VIDEO_CHANNELS, block_out_channels=(8, 16), down_block_types=("LTX2VideoDownBlock3D",) * 2,
        decoder_block_out_channels=(8, 16), layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, True), decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False, False, False), downsample_type=("spatiotemporal",) * 2,
        upsample_type=("spatiotemporal",) * 2, upsample_residual=(True, True), upsample_factor=(2, 2), patch_size=4)
    audio_vae = AutoencoderKLLTX2Audio(base_channels=AUDIO_CHANNELS * MEL_BINS // 4, output_channels=2, ch_mult=(1, 2),
                                       num_res_blocks=1, in_channels=2, latent_channels=AUDIO_CHANNELS,
                                       mel_bins=MEL_BINS, resolution=16)
    with torch.no_grad():  # trained checkpoints' latent statistics are not the init's 0/1
        vae.latents_mean.copy_(torch.linspace(-0.3, 0.3, VIDEO_CHANNELS))
        vae.latents_std.copy_(torch.linspace(0.6, 1.8, VIDEO_CHANNELS))
        audio_vae.latents_mean.copy_(torch.linspace(-0.2, 0.2, audio_vae.latents_mean.numel()))
        audio_vae.latents_std.copy_(torch.linspace(0.7, 1.5, audio_vae.latents_std.numel()))
    vocoder = LTX2Vocoder(in_channels=2 * MEL_BINS, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1]],
                          output_sampling_rate=16000)
    audio_features = AUDIO_CHANNELS * (MEL_BINS // audio_vae.mel_compression_ratio)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=VIDEO_CHANNELS, out_channels=VIDEO_CHANNELS, num_attention_heads=2, attention_head_dim=width // 2,
        cross_attention_dim=width, audio_in_channels=audio_features, audio_out_channels=audio_features,
        audio_num_attention_heads=2, audio_attention_head_dim=width // 2, audio_cross_attention_dim=width,
        num_layers=2, caption_channels=width, gated_attn=v23, audio_gated_attn=v23, cross_attn_mod=v23,
        audio_cross_attn_mod=v23, perturbed_attn=v23, use_prompt_embeddings=not v23,
        vae_scale_factors=(vae.temporal_compression_ratio, vae.spatial_compression_ratio,
                           vae.spatial_compression_ratio))
    return dict(scheduler=ltx2_scheduler(), vae=vae, audio_vae=audio_vae, text_encoder=text_encoder, tokenizer=tok,
                connectors=connectors, transformer=transformer, vocoder=vocoder)
