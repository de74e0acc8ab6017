"""Random pipelines of the HunyuanVideo families' real shapes for `gpu_smoke.py` (beside
real_shapes.py): nothing is downloaded; where a text encoder would dominate memory without
mattering to the RL step it is shortened (fewer layers), and the docstring says so."""

from __future__ import annotations

from pathlib import Path


def hunyuan_video_pipeline(layers: int | None, device: str, workdir: Path):
    """A random HunyuanVideoPipeline with HunyuanVideo's shapes: the transformer (its diffusers
    defaults are the released 13B: 20 dual- and 40 single-stream blocks of 24×128 heads, token
    refiner, guidance embedding), the causal video VAE (16 channels, ×8 in space, ×4 in time),
    llava-llama-3-8b's language model at its real width (4096, 32 heads, 8 KV) with 3 of its 32
    layers (the pipeline reads the third from the top), CLIP-L, the 95-token template tokenizer.
    `--layers N`: N dual- and 2N single-stream blocks."""
    import torch
    from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline,
                           HunyuanVideoTransformer3DModel)
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    from pixrl.models.hunyuan_video import template_tokenizer
    from pixrl.models.tiny_parts import clip_tokenizer

    tok, tok2 = template_tokenizer(workdir / "tokenizer"), clip_tokenizer(workdir / "tokenizer_2")
    text = LlamaModel(LlamaConfig(vocab_size=len(tok), hidden_size=4096, intermediate_size=14336, num_hidden_layers=3,
                                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, rope_parameters={"rope_type": "default",
                                                                                  "rope_theta": 5e5}))
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(tok2), hidden_size=768, intermediate_size=3072,
                                        num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77,
                                        bos_token_id=tok2.bos_token_id, eos_token_id=tok2.eos_token_id,
                                        pad_token_id=tok2.pad_token_id))
    with torch.device(device):  # 13B parameters: created where they run
        transformer = HunyuanVideoTransformer3DModel(
            num_layers=layers or 20, num_single_layers=40 if layers is None else 2 * layers).to(torch.bfloat16)
    return HunyuanVideoPipeline(text_encoder=text, tokenizer=tok, transformer=transformer,
                                vae=AutoencoderKLHunyuanVideo(), scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
                                text_encoder_2=clip, tokenizer_2=tok2)


def skyreels_i2v_pipeline(layers: int | None, device: str, workdir: Path):
    """SkyReels-V1-Hunyuan-I2V: the HunyuanVideo builder's parts with the transformer reading 32
    channels (latents and first-frame latents), as a HunyuanSkyreelsImageToVideoPipeline."""
    import torch
    from diffusers import HunyuanSkyreelsImageToVideoPipeline, HunyuanVideoTransformer3DModel

    parts = hunyuan_video_pipeline(1, "meta", workdir).components
    with torch.device(device):
        parts["transformer"] = HunyuanVideoTransformer3DModel(
            in_channels=32, out_channels=16, num_layers=layers or 20,
            num_single_layers=40 if layers is None else 2 * layers).to(torch.bfloat16)
    return HunyuanSkyreelsImageToVideoPipeline(**parts)


def hunyuan_video15_pipeline(layers: int | None, device: str, workdir: Path):
    """A random HunyuanVideo15Pipeline with HunyuanVideo-1.5's shapes: the transformer (its diffusers
    defaults are the released 8.3B: 54 blocks of 16×128 heads, 65 input channels, token refiner,
    image embedder), the causal video VAE (32 channels, ×16 in space, ×4 in time), Qwen2.5-VL's
    language model at its real width (3584) with 2 of its 28 layers and ByT5's width (1472) with 2
    of its layers, the 108-token template tokenizer, CFG 6. `--layers N`: N blocks."""
    import torch
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel)
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    from pixrl.models.hunyuan_video15 import template_tokenizer

    tok, (tok2, glyph) = template_tokenizer(workdir / "tokenizer"), byt5_small(2)
    text = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tok), hidden_size=3584, intermediate_size=18944, num_hidden_layers=2, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=4096, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}))
    with torch.device(device):
        transformer = HunyuanVideo15Transformer3DModel(num_layers=layers or 54, task_type="t2v").to(torch.bfloat16)
    return HunyuanVideo15Pipeline(text_encoder=text, tokenizer=tok, transformer=transformer,
                                  vae=AutoencoderKLHunyuanVideo15(), scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
                                  text_encoder_2=glyph, tokenizer_2=tok2, guider=ClassifierFreeGuidance(guidance_scale=6.0))


def byt5_small(layers: int):
    """(ByT5Tokenizer, ByT5-small's encoder at its width — 1472, 6 heads of 64, gated-GELU FFN 3584 —
    with `layers` of its 12 layers): the glyph tower of the HunyuanVideo-1.5 and HunyuanImage-2.1 pipelines."""
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tok = ByT5Tokenizer()
    return tok, T5EncoderModel(T5Config(vocab_size=len(tok), d_model=1472, d_kv=64, d_ff=3584, num_layers=layers,
                                        num_heads=6, is_encoder_decoder=False, feed_forward_proj="gated-gelu",
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                        decoder_start_token_id=0))


def hunyuan_video15_i2v_pipeline(layers: int | None, device: str, workdir: Path):
    """HunyuanVideo-1.5's image-to-video: the text-to-video builder's parts (transformer as an i2v
    one) with SigLIP so400m's vision tower (27 × 1152, 384² in 14-px patches: 729 tokens)."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    parts = hunyuan_video15_pipeline(layers, device, workdir).components
    parts["transformer"].register_to_config(task_type="i2v")
    siglip = SiglipVisionModel(SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                                  num_attention_heads=16, image_size=384, patch_size=14))
    return HunyuanVideo15ImageToVideoPipeline(**parts, image_encoder=siglip,
                                              feature_extractor=SiglipImageProcessor(size={"height": 384, "width": 384}))


def ltx_video_pipeline(layers: int | None, device: str, workdir: Path):
    """A random LTXPipeline with LTX-Video 0.9.1's shapes: the 2B transformer (its diffusers
    defaults: 28 blocks of 32×64 heads over 128-channel latents), the 0.9.1 VAE (×32 in space, ×8
    in time; a decoder of 256/512/1024 channels conditioned on the decode timestep, injecting
    noise), T5-XXL at its real width (4096) with 2 of its 24 layers, LTX-Video's dynamic-shift
    scheduler. `--layers N`: N blocks."""
    import torch
    from diffusers import AutoencoderKLLTXVideo, LTXPipeline, LTXVideoTransformer3DModel

    from pixrl.models.ltx_video import ltx_scheduler
    from pixrl.models.tiny_parts import t5_encoder, t5_tokenizer

    tok = t5_tokenizer(workdir / "tokenizer", 128)
    text = t5_encoder(tok, d_model=4096, layers=2)
    vae = AutoencoderKLLTXVideo(
        block_out_channels=(128, 256, 512, 512), layers_per_block=(4, 3, 3, 3, 4),
        spatio_temporal_scaling=(True, True, True, False), decoder_block_out_channels=(256, 512, 1024),
        decoder_layers_per_block=(5, 6, 7, 8), decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(True, True, True, False), upsample_residual=(True, True, True),
        upsample_factor=(2, 2, 2), timestep_conditioning=True)
    with torch.device(device):
        transformer = LTXVideoTransformer3DModel(num_layers=layers or 28).to(torch.bfloat16)
    return LTXPipeline(tokenizer=tok, text_encoder=text, vae=vae, transformer=transformer, scheduler=ltx_scheduler())


def mochi_pipeline(layers: int | None, device: str, workdir: Path):
    """A random MochiPipeline with Mochi 1's shapes: the 10B asymmetric transformer (its diffusers
    defaults: 48 blocks, 24×128 heads over the visual stream, 1536 wide for text, 12-channel
    latents in 2×2 patches), Mochi's VAE (its defaults: ×6 in time, ×8 in space), T5-XXL at its
    real width (4096) with 2 of its 24 layers, the inverted Euler scheduler; empty prompts zeroed.
    `--layers N`: N blocks."""
    import torch
    from diffusers import AutoencoderKLMochi, MochiPipeline, MochiTransformer3DModel

    from pixrl.models.mochi import mochi_scheduler
    from pixrl.models.tiny_parts import t5_encoder, t5_tokenizer

    tok = t5_tokenizer(workdir / "tokenizer", 256)
    text = t5_encoder(tok, d_model=4096, layers=2)
    with torch.device(device):
        transformer = MochiTransformer3DModel(num_layers=layers or 48).to(torch.bfloat16)
    return MochiPipeline(tokenizer=tok, text_encoder=text, vae=AutoencoderKLMochi(), transformer=transformer,
                         scheduler=mochi_scheduler(), force_zeros_for_empty_prompt=True)


def cogvideox_pipeline(layers: int | None, device: str, workdir: Path):
    """A random CogVideoXPipeline with CogVideoX-5B's shapes: the transformer (42 blocks of 48×64
    heads, 3-D rotary positions, 16-channel latents in 2×2 patches), the video VAE (its diffusers
    defaults: ×4 in time, ×8 in space; the 5B's scaling 0.7), T5-XXL at its real width (4096) with
    2 of its 24 layers, the 5B's DPM-Solver (v-prediction, zero terminal SNR, no SNR shift), whose
    table's DDIM grid rollouts step. `--layers N`: N blocks."""
    import torch
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDPMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel

    from pixrl.models.tiny_parts import t5_encoder, t5_tokenizer

    tok = t5_tokenizer(workdir / "tokenizer", 226)
    text = t5_encoder(tok, d_model=4096, layers=2)
    with torch.device(device):
        transformer = CogVideoXTransformer3DModel(num_attention_heads=48, num_layers=layers or 42,
                                                  use_rotary_positional_embeddings=True).to(torch.bfloat16)
    sched = CogVideoXDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
                                  prediction_type="v_prediction", rescale_betas_zero_snr=True, set_alpha_to_one=True,
                                  snr_shift_scale=1.0, timestep_spacing="trailing")
    return CogVideoXPipeline(tokenizer=tok, text_encoder=text, vae=AutoencoderKLCogVideoX(scaling_factor=0.7),
                             transformer=transformer, scheduler=sched)


def wan22_ti2v_5b_pipeline(layers: int | None, device: str, workdir: Path):
    """A random WanPipeline with Wan2.2-TI2V-5B's shapes: the 5B transformer (30 blocks of 24×128
    heads, FFN 14336, 48-channel latents in 1×2×2 patches, a timestep per token), the Wan2.2 VAE
    (residual, 2×2-patchified: ×16 in space, ×4 in time, 48 channels; unit latent statistics here),
    UMT5-XXL at its real width with 2 of its 24 layers, UniPC with flow shift 5. Image-to-video
    (`wan_ti2v`) and text-to-video (`wan`) both load it. `--layers N`: N blocks."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    from real_shapes import wan21_1_3b_pipeline

    base = wan21_1_3b_pipeline(1, "cpu", workdir)  # its tokenizer and UMT5 (the transformer is replaced)
    vae = AutoencoderKLWan(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                           temperal_downsample=[False, True, True], is_residual=True, patch_size=2, in_channels=12,
                           out_channels=12, latents_mean=[0.0] * 48, latents_std=[1.0] * 48, scale_factor_temporal=4,
                           scale_factor_spatial=16)
    with torch.device(device):
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=24, attention_head_dim=128, in_channels=48, out_channels=48,
            text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=layers or 30).to(torch.bfloat16)
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    return WanPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=vae, transformer=transformer,
                       scheduler=sched, expand_timesteps=True)


def cogvideox15_i2v_pipeline(layers: int | None, device: str, workdir: Path):
    """A random CogVideoXImageToVideoPipeline with CogVideoX1.5-5B-I2V's shapes: the transformer (42
    blocks of 48×64 heads, 2×2×2 patches of 16 + 16 channels, rotary positions, the `ofs`
    embedding), the video VAE with 1.5's inverted latent scaling, T5-XXL at its real width with 2 of
    its 24 layers, the DPM-Solver table. `--layers N`: N blocks."""
    import torch
    from diffusers import AutoencoderKLCogVideoX, CogVideoXImageToVideoPipeline, CogVideoXTransformer3DModel

    parts = cogvideox_pipeline(1, "meta", workdir).components
    with torch.device(device):
        parts["transformer"] = CogVideoXTransformer3DModel(
            num_attention_heads=48, num_layers=layers or 42, in_channels=32, out_channels=16, patch_size_t=2,
            ofs_embed_dim=512, sample_height=96, sample_width=170, sample_frames=81,
            use_rotary_positional_embeddings=True).to(torch.bfloat16)
    parts["vae"] = AutoencoderKLCogVideoX(scaling_factor=0.7, invert_scale_latents=True)
    return CogVideoXImageToVideoPipeline(**parts)


def ltx2_pipeline(layers: int | None, device: str, workdir: Path):
    """A random LTX2Pipeline with LTX-2's (19B) shapes: the audio-video DiT (its diffusers defaults:
    48 blocks, 32×128 video heads and 32×64 audio heads, 128 features a token in both streams),
    the video VAE (×32 in space, ×8 in time: one spatial, one temporal and two spatio-temporal
    downsamplings after a 4×4 patch), the audio VAE (8 channels over 64 mel bins, ×4) and
    the vocoder at their defaults, the text connectors at their width (30×128), Gemma-3-12B at its
    real width (3840) with 2 of its 48 layers (the connectors read its 3 states, not 49), LTX-2's
    dynamic-shift scheduler. `--layers N`: N blocks."""
    import torch
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2Pipeline, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder

    from pixrl.models.tiny_ltx2 import gemma3_text_encoder, ltx2_scheduler
    from pixrl.models.tiny_parts import gemma_tokenizer

    tok = gemma_tokenizer(workdir / "tokenizer")
    encoder = gemma3_text_encoder(tok, hidden=3840, layers=2, heads=16, kv_heads=8, head_dim=256,
                                  intermediate=15360).to(torch.bfloat16)  # Gemma-3-12B's widths
    with torch.device(device):
        transformer = LTX2VideoTransformer3DModel(num_layers=layers or 48).to(torch.bfloat16)
    # the class's defaults are LTX-2's VAE, but its ratios must be given (the formula reads four scalings)
    vae = AutoencoderKLLTX2Video(spatial_compression_ratio=32, temporal_compression_ratio=8)
    return LTX2Pipeline(scheduler=ltx2_scheduler(), vae=vae, audio_vae=AutoencoderKLLTX2Audio(),
                        text_encoder=encoder, tokenizer=tok, connectors=LTX2TextConnectors(text_proj_in_factor=3),
                        transformer=transformer, vocoder=LTX2Vocoder())
