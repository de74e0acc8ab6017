"""HunyuanVideo-1.5 text-to-video: diffusers HunyuanVideo15Transformer3DModel (an 8.3B DiT of
54 double-stream blocks over 3-D patches of 32-channel latents), AutoencoderKLHunyuanVideo15
(×4 in time, ×16 in space), two text towers — Qwen2.5-VL's language model (its hidden states two
layers from the top, the prompt under a system message, the template's first 108 tokens cropped
as the pipeline does) and ByT5 for quoted text to render (glyphs; zeros when the prompt quotes
nothing) — and a flow-matching Euler schedule (`linspace(1, 0, T+1)[:-1]`, the scheduler's shift).

What is the family's own, as HunyuanVideo15Pipeline computes it: the transformer reads [noisy
latents; zero condition latents; zero mask] in channels (65 = 32 + 32 + 1; image-to-video puts
its first frame there) and zero image embeddings (729 × 1152, masked out as text-to-video); CFG is
the checkpoint's `guider` (ClassifierFreeGuidance): uncond + s·(cond − uncond) with the empty
prompt, at `sampling.guidance_scale` s (the guider's own scale is what the pipeline uses), its
`guidance_rescale` applied when set. Clips have `model.frames` frames (4k+1; 121 by default).

Not supported (refused by name): the step-distilled checkpoints' MeanFlow (`use_meanflow`: a
second timestep input) and a guider restricted to part of the schedule (start/stop).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .base import ModelLoadError
from .hunyuan_video import decode_clips, shifted_linspace_grid
from .pipelines import PipelineFamily, encodes_text
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime

__all__ = ["HunyuanVideo15Conditioning", "HunyuanVideo15Family"]


@dataclass
class HunyuanVideo15Conditioning:
    """Both towers' states with their masks, as the pipeline's `encode_prompt` returns them."""

    prompt_embeds: torch.Tensor  # [B, L, 3584] Qwen2.5-VL, template cropped
    mask: torch.Tensor  # [B, L]
    glyph_embeds: torch.Tensor  # [B, 256, 1472] ByT5 of the quoted text (zeros: none)
    glyph_mask: torch.Tensor  # [B, 256]

    def select(self, idx) -> "HunyuanVideo15Conditioning":
        return HunyuanVideo15Conditioning(self.prompt_embeds[idx], self.mask[idx], self.glyph_embeds[idx],
                                          self.glyph_mask[idx])

    def expand(self, n: int) -> "HunyuanVideo15Conditioning":
        return HunyuanVideo15Conditioning(*(v.expand(n, *v.shape[1:]) for v in
                                            (self.prompt_embeds, self.mask, self.glyph_embeds, self.glyph_mask)))


@register_family("hunyuan_video15")
class HunyuanVideo15Family(PipelineFamily):
    name = "hunyuan_video15"
    pipeline_class = "HunyuanVideo15Pipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    guidance = "cfg"
    video = True
    text_tokens = (1, 1000)  # Qwen2.5-VL tokens after the template (the pipeline's 1000)
    # the attention projections of both streams (diffusers' HunyuanVideo LoRA targets)
    lora_targets = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                    "attn.add_v_proj", "attn.to_add_out"]
    default_frames = 121  # the pipeline's num_frames
    decode_batch = 1  # clips per VAE decode: 121 frames at 480p hold gigabytes of activations

    options = {"shift": "the flow-matching shift of the sampling grid, in place of the checkpoint's"}

    def __init__(self, pipe, *args, shift: float | None = None, **kwargs):
        super().__init__(pipe, *args, **kwargs)
        if shift is not None:
            self.set_shift(shift)
        path = self.path
        if self.transformer.config.use_meanflow:
            raise ModelLoadError(f"{path!r} is a step-distilled HunyuanVideo-1.5 (use_meanflow: a second timestep "
                                 "input), which the family does not step; use a base checkpoint")
        g = pipe.guider.config
        if g.get("start", 0.0) != 0.0 or g.get("stop", 1.0) != 1.0:
            raise ModelLoadError(f"{path!r}: its guider applies CFG only from {g.get('start')} to {g.get('stop')} of the "
                                 "schedule, which the family does not model; set start 0 and stop 1 in guider/config.json")
        self.guidance_rescale = float(g.get("guidance_rescale", 0.0))
        pipe.tokenizer_max_length = self.max_sequence_length  # the pipeline then encodes as the family does
        self.set_clip_frames()

    @staticmethod
    def default_resolution(pipe) -> tuple[int, int]:
        """The pipeline's default: its 16:9 aspect at the transformer's target size (480p: 480×848)."""
        wide, tall = pipe.default_aspect_ratio
        return pipe.video_processor.calculate_default_height_width(tall, wide, pipe.target_size)

    @staticmethod
    def resolution_multiple(pipe) -> int:
        return pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size

    def describe(self) -> dict:
        return {"resolution": [self.height, self.width], "frames": self.frames,
                "shift": self.scheduler.config.get("shift"), "guidance": self.guidance,
                "guidance_rescale": self.guidance_rescale}

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> HunyuanVideo15Conditioning:
        return self.encode_text(prompts)

    def encode_text(self, prompts: list[str]) -> HunyuanVideo15Conditioning:
        """The pipeline's `encode_prompt`: both towers' states and masks (towers resident)."""
        embeds, mask, glyphs, glyph_mask = self.pipe.encode_prompt(list(prompts), device=self.device,
                                                                   batch_size=len(prompts))
        return HunyuanVideo15Conditioning(embeds, mask, glyphs, glyph_mask)

    # --- dynamics -----------------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int, int]:
        h, w = self.latent_grid(self.pipe.vae_scale_factor_spatial)
        frames = (self.frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        return self.vae.config.latent_channels, frames, h, w

    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(σ [T+1] ending at 0, timesteps [T]) as the pipeline sets them: linspace(1, 0, T+1)[:-1],
        shifted by the scheduler."""
        return shifted_linspace_grid(self.scheduler, steps, self.device)

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: HunyuanVideo15Conditioning,
                 guidance_scale: float = 1.0, neg: HunyuanVideo15Conditioning | None = None) -> torch.Tensor:
        """v_θ(x, t | c) on video latents [B, C, F, H, W]; guidance_scale > 1: the guider's CFG
        (conditional pass, then the empty prompt's), rescaled as its config says."""
        b = x.shape[0]
        t = timestep.reshape(-1).to(x.device)
        t = t.expand(b) if t.numel() == 1 else t
        hidden, image = self._inputs(x, cond)
        v = self._predict(hidden, t.to(hidden.dtype), cond, image)
        if guidance_scale > 1.0:
            if neg is None:
                raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
            v_u = self._predict(hidden, t.to(hidden.dtype), neg, image)
            guided = v_u + guidance_scale * (v - v_u)
            if self.guidance_rescale > 0.0:
                from diffusers.guiders.guider_utils import rescale_noise_cfg

                guided = rescale_noise_cfg(guided, v, self.guidance_rescale)
            v = guided
        return v

    def _inputs(self, x: torch.Tensor, cond) -> tuple[torch.Tensor, torch.Tensor]:
        """(the transformer's hidden states, its image embeddings): text-to-video's are the latents
        beside a zero first-frame condition and mask, and zero image embeddings (read as absent)."""
        dtype = self.transformer.dtype
        hidden = torch.cat([x, torch.zeros_like(x), torch.zeros_like(x[:, :1])], dim=1).to(dtype)
        image = torch.zeros(x.shape[0], self.pipe.vision_num_semantic_tokens, self.transformer.config.image_embed_dim,
                            device=x.device, dtype=dtype)
        return hidden, image

    def _predict(self, hidden, t, cond: HunyuanVideo15Conditioning, image) -> torch.Tensor:
        dtype = hidden.dtype
        return self.transformer(hidden_states=hidden, image_embeds=image, timestep=t,
                                encoder_hidden_states=cond.prompt_embeds.to(dtype),
                                encoder_attention_mask=cond.mask.to(dtype),
                                encoder_hidden_states_2=cond.glyph_embeds.to(dtype),
                                encoder_attention_mask_2=cond.glyph_mask.to(dtype), return_dict=False)[0]

    # --- pixels -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [B, C, F', H', W'] → uint8 clips [B, F, H, W, 3] (`decode_clips`)."""
        return decode_clips(self.vae, latents)

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random HunyuanVideo-1.5-shaped pipeline (`tiny_parts`) saved in the diffusers layout.
        Returns the overrides that run it (64 px — 4 × 4 latents — and 5 frames)."""
        import shutil

        from diffusers import HunyuanVideo15Pipeline

        build = out_dir.parent / (out_dir.name + "_build")
        HunyuanVideo15Pipeline(**tiny_parts(build, seed)).save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 64, "model.frames": 5,
                "model.max_sequence_length": 64}


def tiny_parts(build: Path, seed: int, **transformer) -> dict:
    """Seeded tiny HunyuanVideo-1.5 components: a tiny Qwen2.5-VL language model with the template
    tokenizer, a tiny ByT5 encoder, the causal video VAE (×4 in time, ×16 in space here as there, 4
    latent channels), a 2-block DiT with its token refiner and image embedder (`transformer`:
    further config), the Euler scheduler (shift 7) and a CFG guider (6)."""
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideo15Transformer3DModel)
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    from .tiny_parts import byt5_glyph_encoder

    torch.manual_seed(seed)
    tok = template_tokenizer(build / "tokenizer")
    text = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2048, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}))
    tok2, glyph = byt5_glyph_encoder()
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 16, 16, 16), layers_per_block=1,
                                      spatial_compression_ratio=16, temporal_compression_ratio=4)
    dit = HunyuanVideo15Transformer3DModel(**{
        **dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
               num_refiner_layers=1, text_embed_dim=32, text_embed_2_dim=16, image_embed_dim=16,
               rope_axes_dim=(4, 6, 6), task_type="t2v"), **transformer})
    return dict(text_encoder=text, tokenizer=tok, transformer=dit, vae=vae,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=glyph, tokenizer_2=tok2,
                guider=ClassifierFreeGuidance(guidance_scale=6.0))


def template_tokenizer(out_dir: Path):
    """A tiny Qwen2 tokenizer with a ChatML template under which the pipeline's system message and
    the user turn's header are 108 tokens, as with Qwen2.5-VL's own tokenizer — so the pipeline's
    fixed crop (108) drops exactly the template and keeps the prompt (with a character-level split
    it would keep system text as if it were the prompt, and cut every prompt away). Its words are
    whole tokens, a run of 8 spaces one token, as Qwen's BPE splits them."""
    import inspect
    import re

    from diffusers import HunyuanVideo15Pipeline
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

    from .tiny_parts import qwen2_tokenizer
    from .z_image import QWEN3_CHAT_TEMPLATE

    system = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    words = sorted(set(re.findall(r"[A-Za-z]+", system)))
    tok = qwen2_tokenizer(out_dir, ["Ġ" + w for w in words] + ["You", "ĠĠ"],
                          [("ĠĠ", "ĠĠ"), ("ĠĠĠĠ", "ĠĠĠĠ"), ("Ġ", "Describe"), ("Ġ", "use"), ("Ġuse", "d")])
    tok.chat_template = QWEN3_CHAT_TEMPLATE  # ChatML turns, as Qwen2.5-VL's template writes them
    tok.save_pretrained(str(out_dir))
    marker = "a red circle"
    text = tok.apply_chat_template(format_text_input([marker], system)[0], tokenize=False, add_generation_prompt=True)
    crop = len(tok(text[: text.index(marker)]).input_ids)
    if crop != CROP:
        raise AssertionError(f"the tiny template is {crop} tokens before the prompt; the pipeline crops {CROP}")
    return tok


CROP = 108  # HunyuanVideo15Pipeline.prompt_template_encode_start_idx

