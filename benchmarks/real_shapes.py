"""Random pipelines of each family's real shapes (layer counts, widths, heads, VAEs), built on
the device that runs them, for `gpu_smoke.py`: nothing is downloaded, so the figures measure
memory and speed at the real sizes, not images. Where a text encoder would dominate memory
without mattering to the RL step it is shortened (fewer layers), and the docstring says so."""

from __future__ import annotations

from pathlib import Path

from real_shapes_image import (cosmos2_2b_pipeline, cosmos2_2b_v2w_pipeline, cosmos25_2b_pipeline, glm_image_pipeline,
                               hunyuan_image_pipeline)
from real_shapes_edit import qwen_image21_pipeline, qwen_image_edit_pipeline, qwen_image_edit_plus_pipeline
from real_shapes_video import (cogvideox15_i2v_pipeline, cogvideox_pipeline, hunyuan_video15_i2v_pipeline, hunyuan_video15_pipeline,
                               hunyuan_video_pipeline, ltx2_pipeline, ltx_video_pipeline, mochi_pipeline, skyreels_i2v_pipeline,
                               wan22_ti2v_5b_pipeline)


def sd35_medium_pipeline(resolution: int, seed: int, workdir: Path, layers: int | None = None):
    """A random StableDiffusion3Pipeline with SD3.5-Medium's transformer, VAE and CLIP shapes
    (`layers`: fewer MMDiT blocks than its 24, the first 13 of them dual-attention)."""
    import torch
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from pixrl.models.mini.build import shapes_vocabulary
    from pixrl.models.mini.tokenizer import write_word_tokenizer

    torch.manual_seed(seed)
    tok = write_word_tokenizer(shapes_vocabulary(), workdir / "tokenizer", 77)

    def clip(hidden: int, layers: int, heads: int) -> CLIPTextModelWithProjection:
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, projection_dim=hidden, max_position_embeddings=77, hidden_act="gelu",
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))

    transformer = SD3Transformer2DModel(
        sample_size=resolution // 8, patch_size=2, in_channels=16, out_channels=16, num_layers=layers or 24,
        attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
        pooled_projection_dim=2048, pos_embed_max_size=384, qk_norm="rms_norm",
        dual_attention_layers=tuple(range(min(13, layers or 24))))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
        latent_channels=16, sample_size=resolution, scaling_factor=1.5305, shift_factor=0.0609,
        use_quant_conv=False, use_post_quant_conv=False)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=clip(768, 12, 12), tokenizer=tok, text_encoder_2=clip(1280, 32, 20), tokenizer_2=tok,
        text_encoder_3=None, tokenizer_3=None)


def flux1_dev_pipeline(layers: int | None, device: str, workdir: Path):
    """A random FluxPipeline with FLUX.1-dev's transformer and VAE shapes (T5 shortened)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    from pixrl.models.tiny_parts import clip_text_model, clip_tokenizer, t5_encoder, t5_tokenizer

    tok, tok2 = clip_tokenizer(workdir / "tokenizer"), t5_tokenizer(workdir / "tokenizer_2", 512)
    with torch.device(device):  # 12B parameters: created where they run
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=layers or 19, num_single_layers=38 if layers is None else 2 * layers,
            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
            guidance_embeds=True, axes_dims_rope=(16, 56, 56)).to(torch.bfloat16)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                        layers_per_block=2, latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159,
                        use_quant_conv=False, use_post_quant_conv=False)
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                            base_image_seq_len=256, max_image_seq_len=4096)
    return FluxPipeline(scheduler=sched, vae=vae, text_encoder=clip_text_model(tok, hidden=768, layers=12),
                        tokenizer=tok, text_encoder_2=t5_encoder(tok2, d_model=4096, layers=2), tokenizer_2=tok2,
                        transformer=transformer)


def flux1_kontext_dev_pipeline(layers: int | None, device: str, workdir: Path):
    """FLUX.1-Kontext-dev: FLUX.1-dev's transformer and VAE (the same shapes) in a FluxKontextPipeline."""
    from diffusers import FluxKontextPipeline

    parts = flux1_dev_pipeline(layers, device, workdir).components
    return FluxKontextPipeline(**{k: v for k, v in parts.items() if v is not None})


def qwen_image_pipeline(layers: int | None, device: str, workdir: Path):
    """A random QwenImagePipeline with Qwen-Image's transformer and VAE shapes (text encoder shortened)."""
    import torch
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)

    from pixrl.models.tiny_parts import qwen2_tokenizer, qwen25_vl_text_encoder

    tok = qwen2_tokenizer(workdir / "tokenizer")
    with torch.device(device):  # 20B parameters: created where they run
        transformer = QwenImageTransformer2DModel(num_layers=layers or 60).to(torch.bfloat16)  # defaults: real shapes
    sched = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                            base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                            time_shift_type="exponential")
    return QwenImagePipeline(scheduler=sched, vae=AutoencoderKLQwenImage(), transformer=transformer, tokenizer=tok,
                             text_encoder=qwen25_vl_text_encoder(tok, hidden=3584, layers=2))


def sana_1600m_pipeline(layers: int | None, device: str, workdir: Path):
    """A random SanaPipeline with SANA-1600M's transformer (20 linear-attention blocks, 70×32 heads,
    cross-attention 20×112) and the DC-AE f32c32 VAE; Gemma-2-2B at its real width (2304) with 2
    of its 26 layers."""
    import inspect
    import re

    import torch
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    from pixrl.models.tiny_parts import gemma_tokenizer

    instruction = inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default
    tok = gemma_tokenizer(workdir / "tokenizer", re.findall(r"[A-Za-z]+", " ".join(instruction)))
    text_encoder = Gemma2Model(Gemma2Config(
        vocab_size=len(tok), hidden_size=2304, intermediate_size=9216, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id))
    with torch.device(device):
        transformer = SanaTransformer2DModel(
            in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=layers or 20,
            num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
            caption_channels=2304, mlp_ratio=2.5, sample_size=32, patch_size=1).to(torch.bfloat16)
    vit = ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3
    vae = AutoencoderDC(encoder_block_types=vit, decoder_block_types=vit, downsample_block_type="Conv",
                        upsample_block_type="interpolate", decoder_norm_types=("batch_norm",) * 3 + ("rms_norm",) * 3,
                        decoder_act_fns=("relu",) * 3 + ("silu",) * 3, scaling_factor=0.41407)
    sched = DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2, prediction_type="flow_prediction",
                                        use_flow_sigmas=True, flow_shift=3.0)
    return SanaPipeline(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=sched)


def flux2_dev_pipeline(layers: int | None, device: str, workdir: Path):
    """A random Flux2Pipeline with FLUX.2-dev's transformer (8 double + 48 single blocks, 48×128
    heads, text width 15360; 32B) and VAE; the Mistral-3 text encoder at its real width (5120)
    with the 30 layers the pipeline reads and a narrow MLP (the 24B encoder is frozen and runs
    once per prompt). `--layers N`: N double and 6·N single blocks."""
    import re

    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from pixrl.models.tiny_parts import mistral3_tokenizer

    tok = mistral3_tokenizer(workdir / "tokenizer", re.findall(r"[A-Za-z]+", SYSTEM_MESSAGE))
    with torch.device(device):
        text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
            text_config=dict(model_type="mistral", vocab_size=len(tok), hidden_size=5120, intermediate_size=1024,
                             num_hidden_layers=30, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                             pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id),
            vision_config=dict(model_type="pixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=2, head_dim=32, image_size=64, patch_size=8),
            image_token_index=tok.convert_tokens_to_ids("[IMG]"))).to(torch.bfloat16)
        transformer = Flux2Transformer2DModel(
            num_layers=layers or 8, num_single_layers=48 if layers is None else 6 * layers).to(torch.bfloat16)
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                            base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")
    return Flux2Pipeline(scheduler=sched, vae=AutoencoderKLFlux2(), text_encoder=text_encoder, tokenizer=tok,
                         transformer=transformer)


def wan21_1_3b_pipeline(layers: int | None, device: str, workdir: Path):
    """A random WanPipeline with Wan2.1-T2V-1.3B's transformer (30 blocks, 12×128 heads, FFN 8960)
    and its causal video VAE; UMT5-XXL at its real width (4096) with 2 of its 24 layers."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from pixrl.models.tiny_parts import t5_tokenizer

    tok = t5_tokenizer(workdir / "tokenizer", 512)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tok), d_model=4096, d_kv=64, d_ff=10240, num_layers=2, num_heads=64,
        feed_forward_proj="gated-gelu", is_encoder_decoder=False, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, decoder_start_token_id=0))
    with torch.device(device):
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
            text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=layers or 30).to(torch.bfloat16)
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(tokenizer=tok, text_encoder=text_encoder, vae=AutoencoderKLWan(), transformer=transformer,
                       scheduler=sched)


def wan22_a14b_pipeline(layers: int | None, device: str, workdir: Path):
    """A random two-expert WanPipeline with Wan2.2-T2V-A14B's shapes: two 14B transformers (40
    blocks, 40×128 heads, FFN 13824) switched at boundary_ratio 0.875, the Wan2.1 VAE; UMT5-XXL at
    its real width with 2 of its 24 layers. `--layers N`: N blocks per expert."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    base = wan21_1_3b_pipeline(1, "cpu", workdir)  # its tokenizer and UMT5 (the transformer is replaced)

    def expert():
        with torch.device(device):
            return WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=layers or 40).to(torch.bfloat16)

    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=AutoencoderKLWan(),
                       transformer=expert(), transformer_2=expert(), boundary_ratio=0.875, scheduler=sched)


def wan21_i2v_14b_pipeline(layers: int | None, device: str, workdir: Path):
    """A random WanImageToVideoPipeline with Wan2.1-I2V-14B-480P's shapes: the transformer (40 blocks,
    40×128 heads, FFN 13824, 36 input channels: latents + first-frame mask + first-frame latents;
    CLIP image states through 5120-wide added key/value projections), CLIP ViT-H/14's vision tower
    (32 × 1280, 224²), the Wan2.1 VAE; UMT5-XXL at its real width with 2 of its 24 layers.
    `--layers N`: N blocks (40 in the real one)."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    base = wan21_1_3b_pipeline(1, "cpu", workdir)  # its tokenizer and UMT5 (the transformer is replaced)
    with torch.device(device):
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=36, out_channels=16,
            text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=layers or 40, image_dim=1280,
            added_kv_proj_dim=5120).to(torch.bfloat16)
    clip = CLIPVisionModel(CLIPVisionConfig(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                            num_attention_heads=16, image_size=224, patch_size=14, hidden_act="gelu"))
    processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                                   image_mean=[0.48145466, 0.4578275, 0.40821073],
                                   image_std=[0.26862954, 0.26130258, 0.27577711])
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanImageToVideoPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=AutoencoderKLWan(),
                                   image_encoder=clip, image_processor=processor, transformer=transformer,
                                   scheduler=sched)


def z_image_turbo_pipeline(layers: int | None, device: str, workdir: Path):
    """A random ZImagePipeline with Z-Image-Turbo's shapes: the transformer (ZImageTransformer2DModel's
    defaults are the released model's: 30 blocks of width 3840, 30 heads, 2 noise and 2 caption
    refiner blocks, caption width 2560), the FLUX.1 VAE (16 channels, scale 0.3611, shift 0.1159)
    and the Turbo's static-shift scheduler; Qwen3-4B at its real width with 2 of its 36 layers and
    the ChatML template. `--layers N`: N main blocks."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    from pixrl.models.z_image import qwen3_text_tower

    tok, text = qwen3_text_tower(workdir / "tokenizer", hidden=2560, ffn=9728, layers=2, heads=32, kv_heads=8,
                                 head_dim=128)
    with torch.device(device):
        transformer = ZImageTransformer2DModel(n_layers=layers or 30).to(torch.bfloat16)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                        layers_per_block=2, latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159,
                        use_quant_conv=False, use_post_quant_conv=False)
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return ZImagePipeline(scheduler=sched, vae=vae, text_encoder=text, tokenizer=tok, transformer=transformer)


def janus_pro_1b_checkpoint(layers: int | None, device: str, out: Path) -> Path:
    """A random JanusForConditionalGeneration with Janus-Pro-1B's shapes — the DeepSeek-LLM 1.5B
    decoder (24 layers of width 2048, 16 heads, FFN 5632, vocabulary 102400), the SigLIP-L vision
    tower, the 16384-code VQ-VAE (24×24 tokens → 384²) and the 2048-wide generation aligner/head —
    saved in the transformers layout with the Janus tokenizer files (a small vocabulary; its ids
    are a subset of the model's)."""
    import torch
    from transformers import JanusConfig, JanusForConditionalGeneration, JanusVisionConfig, JanusVQVAEConfig, LlamaConfig

    from pixrl.models.tiny_parts import janus_generation_config, janus_tokenizer

    tok = janus_tokenizer(out)
    text = LlamaConfig(vocab_size=102400, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers or 24,
                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=16384,
                       pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = JanusVisionConfig(projection_dim=2048)  # SigLIP-L/16 at 384², 576 image tokens
    vq = JanusVQVAEConfig(projection_dim=2048, image_token_embed_dim=2048)
    with torch.device(device):
        model = JanusForConditionalGeneration(JanusConfig(text_config=text, vision_config=vision, vq_config=vq,
                                                          image_token_id=tok.convert_tokens_to_ids(tok.image_token)))
    model.to(torch.bfloat16)
    model.generation_config = janus_generation_config(tok, guidance_scale=5.0)
    model.save_pretrained(str(out))
    return out


def sd15_pipeline(layers: int | None, device: str, workdir: Path):
    """A random StableDiffusionPipeline with SD1.5's shapes: the UNet (320/640/1280/1280 channels,
    2 layers a block, cross-attention 768, 8 heads; 860M), the SD VAE (quant convs, 0.18215) and
    CLIP-L (12 layers of 768); SD1.5's PNDM scheduler config. `layers` is not used."""
    import torch
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from pixrl.models.mini.build import shapes_vocabulary
    from pixrl.models.mini.tokenizer import write_word_tokenizer

    torch.manual_seed(0)
    tok = write_word_tokenizer(shapes_vocabulary(), workdir / "tokenizer", 77)
    text = CLIPTextModel(CLIPTextConfig(vocab_size=len(tok), hidden_size=768, intermediate_size=3072,
                                        num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77,
                                        hidden_act="quick_gelu", bos_token_id=tok.bos_token_id,
                                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                        layers_per_block=2, latent_channels=4, sample_size=512, scaling_factor=0.18215)
    sched = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", set_alpha_to_one=False,
                          skip_prk_steps=True, steps_offset=1)
    sched.register_to_config(clip_sample=False)
    return StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=tok, unet=unet, scheduler=sched,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def sdxl_pipeline(layers: int | None, device: str, workdir: Path):
    """A random StableDiffusionXLPipeline with SDXL base's shapes: the UNet (320/640/1280 channels,
    1/2/10 transformer layers, cross-attention 2048, text-time added conditioning; 2.6B), the VAE,
    CLIP-L (12 × 768) and OpenCLIP-bigG (32 × 1280, projection 1280). `layers` is not used."""
    import torch
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from pixrl.models.mini.build import shapes_vocabulary
    from pixrl.models.mini.tokenizer import write_word_tokenizer

    torch.manual_seed(0)
    tok = write_word_tokenizer(shapes_vocabulary(), workdir / "tokenizer", 77)

    def config(hidden: int, layers: int, heads: int, act: str) -> CLIPTextConfig:
        return CLIPTextConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden,
                              num_hidden_layers=layers, num_attention_heads=heads, projection_dim=hidden,
                              max_position_embeddings=77, hidden_act=act, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)

    unet = UNet2DConditionModel(
        sample_size=128, block_out_channels=(320, 640, 1280), layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 2, 10),
        attention_head_dim=(5, 10, 20), cross_attention_dim=2048, use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                        layers_per_block=2, latent_channels=4, sample_size=1024, scaling_factor=0.13025)
    sched = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1,
                                   timestep_spacing="leading")
    sched.register_to_config(set_alpha_to_one=False, clip_sample=False)
    return StableDiffusionXLPipeline(
        vae=vae, text_encoder=CLIPTextModel(config(768, 12, 12, "quick_gelu")), tokenizer=tok,
        text_encoder_2=CLIPTextModelWithProjection(config(1280, 32, 20, "gelu")), tokenizer_2=tok, unet=unet,
        scheduler=sched, force_zeros_for_empty_prompt=True, add_watermarker=False)



def pixart_sigma_pipeline(layers: int | None, device: str, workdir: Path):
    """A random PixArtSigmaPipeline with PixArt-Σ XL-2's shapes (its diffusers defaults: 28 blocks of
    16×72 heads, learned variance, T5-XXL captions) at 512 (sample_size 64), the SDXL VAE, T5-XXL at
    its real width (4096) with 2 of its 24 layers, the shipped DPM-Solver++ config."""
    import torch
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    from pixrl.models.tiny_parts import t5_encoder, t5_tokenizer

    tok = t5_tokenizer(workdir / "tokenizer", 300)
    text = t5_encoder(tok, d_model=4096, layers=2)
    with torch.device(device):
        transformer = PixArtTransformer2DModel(num_layers=layers or 28, sample_size=64, caption_channels=4096,
                                               use_additional_conditions=False).to(torch.bfloat16)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                        layers_per_block=2, latent_channels=4, scaling_factor=0.13025)
    sched = DPMSolverMultistepScheduler(beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
                                        algorithm_type="dpmsolver++", timestep_spacing="linspace")
    return PixArtSigmaPipeline(tokenizer=tok, text_encoder=text, vae=vae, transformer=transformer, scheduler=sched)

BUILDERS = {"sd15": sd15_pipeline, "sdxl": sdxl_pipeline, "flux1": flux1_dev_pipeline,
            "flux1_kontext": flux1_kontext_dev_pipeline, "qwen_image": qwen_image_pipeline, "sana": sana_1600m_pipeline,
            "flux2": flux2_dev_pipeline, "wan": wan21_1_3b_pipeline, "wan_a14b": wan22_a14b_pipeline,
            "wan_i2v": wan21_i2v_14b_pipeline, "z_image": z_image_turbo_pipeline,
            "hunyuan_video": hunyuan_video_pipeline, "hunyuan_video15": hunyuan_video15_pipeline,
            "hunyuan_video15_i2v": hunyuan_video15_i2v_pipeline, "skyreels_i2v": skyreels_i2v_pipeline,
            "pixart_sigma": pixart_sigma_pipeline, "qwen_image_edit": qwen_image_edit_pipeline,
            "qwen_image_edit_plus": qwen_image_edit_plus_pipeline, "qwen_image21": qwen_image21_pipeline,
            "ltx_video": ltx_video_pipeline, "ltx_video_i2v": ltx_video_pipeline, "mochi": mochi_pipeline, "cogvideox": cogvideox_pipeline, "cogvideox_i2v": cogvideox15_i2v_pipeline,
            "wan_ti2v": wan22_ti2v_5b_pipeline, "cosmos2": cosmos2_2b_pipeline,
            "cosmos2_v2w": cosmos2_2b_v2w_pipeline, "cosmos25": cosmos25_2b_pipeline,
            "glm_image": glm_image_pipeline, "glm_image_ar": glm_image_pipeline, "hunyuan_image": hunyuan_image_pipeline,
            "ltx2": ltx2_pipeline, "ltx2_i2v": ltx2_pipeline}
