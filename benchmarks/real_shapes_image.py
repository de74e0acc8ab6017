"""A random Cosmos-Predict2-2B (Text2Image, Video2World), Cosmos-Predict2.5-2B, GLM-Image and HunyuanImage-2.1 of their real shapes for `gpu_smoke.py` (beside
real_shapes.py): nothing is downloaded; T5-11B keeps its real width with 2 of its 24 layers, as
the other families' text encoders are shortened there."""

from __future__ import annotations

from pathlib import Path


def cosmos2_2b_pipeline(layers: int | None, device: str, workdir: Path, video2world: bool = False):
    """The 2B's transformer (28 blocks of 16×128 heads, MLP ratio 4, adaLN-LoRA 256, T5 width 1024,
    RoPE scale (1, 4, 4), a padding-mask channel, no learnable position embedding — the diffusers
    conversion's "Cosmos-2.0-Diffusion-2B-Text2Image"), the Wan2.1 VAE, T5-11B's encoder at its
    width (1024, 128 heads of 128, ReLU FFN 65536) with 2 layers, the Karras EDM scheduler. `--layers N`:
    N blocks (the 14B has 36 of 40×128). `video2world`: the 2B Video2World's — the condition-mask
    channel in (17 channels), RoPE scale (1, 3, 3)."""
    import torch
    from diffusers import AutoencoderKLWan, CosmosTransformer3DModel
    from transformers import T5Config, T5EncoderModel

    from pixrl.models.cosmos2 import cosmos2_pipeline, cosmos2_scheduler
    from pixrl.models.tiny_parts import t5_tokenizer

    tok = t5_tokenizer(workdir / "tokenizer", 512)
    text = T5EncoderModel(T5Config(vocab_size=len(tok), d_model=1024, d_kv=128, d_ff=65536, num_layers=2,
                                   num_heads=128, feed_forward_proj="relu", is_encoder_decoder=False,
                                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                   decoder_start_token_id=0))
    with torch.device(device):
        transformer = CosmosTransformer3DModel(
            in_channels=17 if video2world else 16, out_channels=16, num_attention_heads=16, attention_head_dim=128, num_layers=layers or 28,
            mlp_ratio=4.0, text_embed_dim=1024, adaln_lora_dim=256, max_size=(128, 240, 240), patch_size=(1, 2, 2),
            rope_scale=(1.0, 3.0, 3.0) if video2world else (1.0, 4.0, 4.0), concat_padding_mask=True, extra_pos_embed_type=None).to(torch.bfloat16)
    pipeline = "Cosmos2VideoToWorldPipeline" if video2world else "Cosmos2TextToImagePipeline"
    return cosmos2_pipeline(pipeline, text_encoder=text, tokenizer=tok, transformer=transformer, vae=AutoencoderKLWan(),
                            scheduler=cosmos2_scheduler())


def cosmos25_2b_pipeline(layers: int | None, device: str, workdir: Path):
    """Cosmos-Predict2.5-2B: the 2B Cosmos DiT (28 blocks of 16×128 heads, the condition-mask
    channel in) projecting the text's concatenated layer states to 1024, the Wan2.1 VAE, UniPC on
    flow sigmas (shift 5 here; a checkout's own scheduler config is read from it); Cosmos-Reason1
    (Qwen2.5-VL-7B) at its real width (3584, 28×128 heads) with 2 of its 28 layers — so the
    projection reads 2 × 3584 values per token where the real one reads 28 × 3584."""
    import torch
    from diffusers import AutoencoderKLWan, CosmosTransformer3DModel, UniPCMultistepScheduler
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from pixrl.models.cosmos2 import cosmos2_pipeline
    from pixrl.models.tiny_parts import QWEN_VL_CHAT_TEMPLATE, qwen2_tokenizer

    tok = qwen2_tokenizer(workdir / "tokenizer")
    tok.chat_template = QWEN_VL_CHAT_TEMPLATE
    special = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id, "bos_token_id": tok.eos_token_id}
    text = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=3584, intermediate_size=18944, num_hidden_layers=2,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=4096, **special,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=3584,
                           fullatt_block_indexes=[0]), **special))
    with torch.device(device):
        transformer = CosmosTransformer3DModel(
            in_channels=17, out_channels=16, num_attention_heads=16, attention_head_dim=128, num_layers=layers or 28,
            mlp_ratio=4.0, text_embed_dim=1024, adaln_lora_dim=256, max_size=(128, 240, 240), patch_size=(1, 2, 2),
            rope_scale=(1.0, 3.0, 3.0), concat_padding_mask=True, extra_pos_embed_type=None,
            use_crossattn_projection=True, crossattn_proj_in_channels=2 * 3584,
            encoder_hidden_states_channels=1024).to(torch.bfloat16)
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    return cosmos2_pipeline("Cosmos2_5_PredictBasePipeline", text_encoder=text, tokenizer=tok,
                            transformer=transformer, vae=AutoencoderKLWan(), scheduler=sched)


def cosmos2_2b_v2w_pipeline(layers: int | None, device: str, workdir: Path):
    """Cosmos-Predict2-2B-Video2World of its real shapes (`cosmos2_2b_pipeline`'s, video2world)."""
    return cosmos2_2b_pipeline(layers, device, workdir, video2world=True)


def glm_image_pipeline(layers: int | None, device: str, workdir: Path):
    """GLM-Image of its real shapes: the DiT decoder (30 blocks of 32×128 heads, glyph width 1472,
    a 16384-entry prior codebook, 16 latent channels), ByT5-small's encoder (12 layers of 1472),
    a 16-channel 8× VAE, CogView4's linear dynamic shift; the autoregressive model at GLM-4-9B's
    width (4096, 32 heads with 2 KV heads, FFN 13696, half-rotary 3-D RoPE) with 2 of its 40
    layers and one vision block, over the 16384 codebook. `--layers N`: N decoder blocks."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImagePipeline, GlmImageTransformer2DModel

    from pixrl.models.tiny_glm_image import glm_image_ar, glm_image_processor, glyph_tower

    codebook = 16384
    proc = glm_image_processor(workdir / "processor", codebook)
    ar = glm_image_ar(proc.tokenizer, codebook,
                      text={"hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 2,
                            "num_attention_heads": 32, "num_key_value_heads": 2,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": [8, 12, 12], "partial_rotary_factor": 0.5}},
                      vision={"depth": 1, "hidden_size": 1536, "num_heads": 16, "intermediate_size": 6144,
                              "image_size": 2048}, vq={"embed_dim": 2048, "latent_channels": 1536}).to(torch.bfloat16)
    tok, text = glyph_tower(d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
                            relative_attention_num_buckets=32, relative_attention_max_distance=128)
    with torch.device(device):
        transformer = GlmImageTransformer2DModel(num_layers=layers or 30, num_attention_heads=32, attention_head_dim=128,
                                                 text_embed_dim=1472, prior_vq_quantizer_codebook_size=codebook
                                                 ).to(torch.bfloat16)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                        layers_per_block=2, latent_channels=16, latents_mean=[0.0] * 16, latents_std=[1.0] * 16)
    sched = FlowMatchEulerDiscreteScheduler(base_shift=0.25, max_shift=0.75, base_image_seq_len=256,
                                            use_dynamic_shifting=True, time_shift_type="linear")
    return GlmImagePipeline(tokenizer=tok, processor=proc, text_encoder=text, vision_language_encoder=ar, vae=vae,
                            transformer=transformer, scheduler=sched)


def hunyuan_image_pipeline(layers: int | None, device: str, workdir: Path):
    """HunyuanImage-2.1 of its real shapes: the 17B DiT (its diffusers defaults: 20 double- and 40
    single-stream blocks of 28×128 heads over 64 latent channels, the token refiner) with the ByT5
    projection (width 1472), the ×32 VAE (64 channels), Qwen2.5-VL-7B's language model at its width
    (3584) with 2 of its 28 layers, ByT5-small's at its width with 2 layers, Qwen-Image's template
    tokenizer (34 tokens dropped), the Euler scheduler (shift 5) and the checkpoint's APG guiders
    (CFG 3.5, then APG 10 with momentum −0.5 after step 5). `--layers N`: N double-, 2N single-stream blocks."""
    import torch
    from diffusers import (AdaptiveProjectedMixGuidance, AutoencoderKLHunyuanImage, FlowMatchEulerDiscreteScheduler,
                           HunyuanImagePipeline, HunyuanImageTransformer2DModel)
    from real_shapes_video import byt5_small

    from pixrl.models.tiny_parts import qwen2_tokenizer, qwen25_vl_text_encoder

    tok = qwen2_tokenizer(workdir / "tokenizer")
    tok2, glyph = byt5_small(2)
    with torch.device(device):
        transformer = HunyuanImageTransformer2DModel(num_layers=layers or 20, num_single_layers=40 if layers is None
                                                     else 2 * layers, text_embed_2_dim=1472).to(torch.bfloat16)
    vae = AutoencoderKLHunyuanImage(in_channels=3, out_channels=3, latent_channels=64, layers_per_block=2,
                                    block_out_channels=(128, 256, 512, 512, 1024, 1024), spatial_compression_ratio=32,
                                    sample_size=384, scaling_factor=0.75289)
    return HunyuanImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), vae=vae, transformer=transformer,
                                text_encoder=qwen25_vl_text_encoder(tok, hidden=3584, layers=2), tokenizer=tok,
                                text_encoder_2=glyph, tokenizer_2=tok2, guider=AdaptiveProjectedMixGuidance(),
                                ocr_guider=AdaptiveProjectedMixGuidance())
