"""A random Cosmos-Predict2-2B (Text2Image, Video2World) and Cosmos-Predict2.5-2B of their real shapes for `gpu_smoke.py` (beside
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
