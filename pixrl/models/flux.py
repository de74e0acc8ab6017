"""FLUX.1 family (dev, schnell): diffusers FluxTransformer2DModel + AutoencoderKL (16 latent
channels, scaling and shift factors) + FlowMatchEulerDiscreteScheduler with dynamic shift +
CLIP (pooled) and T5 (per-token) text encoders.

Loads any directory in the diffusers FluxPipeline layout and reuses the pipeline's own
`encode_prompt`, latent packing and image ids, so conditioning and velocity are exactly what
the pipeline computes. Latents are kept unpacked ([C, H, W], as the pipeline draws its noise);
`velocity` packs them into the 2×2-patch sequence the transformer reads and unpacks its output.
The flow-matching step is elementwise, so stepping unpacked latents is the pipeline's step.

Guidance is FLUX.1-dev's distilled guidance: the scale enters the transformer as an embedding
(`guidance_embeds`), there is no negative-prompt batch. A model without the embedding
(schnell) ignores the scale, as the pipeline does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .pipelines import PackedLatentsFamily, encodes_text
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime

__all__ = ["FluxConditioning", "FluxFamily"]


@dataclass
class FluxConditioning:
    """FLUX.1's text conditioning: T5 per-token embeddings, CLIP pooled, the text position ids."""

    prompt_embeds: torch.Tensor  # [B, L, D]
    pooled: torch.Tensor  # [B, P]
    text_ids: torch.Tensor  # [L, 3], shared by the batch

    def select(self, idx) -> "FluxConditioning":
        return FluxConditioning(self.prompt_embeds[idx], self.pooled[idx], self.text_ids)

    def expand(self, n: int) -> "FluxConditioning":
        return FluxConditioning(self.prompt_embeds.expand(n, -1, -1), self.pooled.expand(n, -1), self.text_ids)


@register_family("flux1")
class FluxFamily(PackedLatentsFamily):
    """A loaded FLUX.1 model: what the shared denoise sampler and the trainer need."""

    name = "flux1"
    pipeline_class = "FluxPipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    guidance = "embedded"  # the scale is a transformer input; no negative prompt is encoded
    text_tokens = (1, 512)  # T5: 512 for dev, 256 for schnell
    # flow_grpo's LoRA targets for FLUX (scripts/train_flux.py): both streams' attention and MLPs
    lora_targets = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                    "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                    "ff_context.net.2"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ids: dict[tuple, torch.Tensor] = {}

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> FluxConditioning:
        return self.encode_text(prompts)

    def encode_text(self, prompts: list[str]) -> FluxConditioning:
        """CLIP pooled and T5 per-token embeddings, as the pipeline's `encode_prompt` makes them."""
        embeds, pooled, text_ids = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, device=self.device,
                                                           max_sequence_length=self.max_sequence_length)
        return FluxConditioning(embeds, pooled, text_ids)

    # --- dynamics -----------------------------------------------------------------------------
    def _image_ids(self, h: int, w: int, device, dtype) -> torch.Tensor:
        key = (h, w, str(device), dtype)
        if key not in self._ids:
            self._ids[key] = self.pipe._prepare_latent_image_ids(1, h // 2, w // 2, device, dtype)
        return self._ids[key]

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: FluxConditioning,
                 guidance_scale: float = 1.0, neg: FluxConditioning | None = None) -> torch.Tensor:
        """v_θ(x, t | c) on unpacked latents [B, C, H, W]; the guidance scale as FLUX.1-dev's embedding."""
        return self.denoise(x, timestep, cond, guidance_scale)

    def denoise(self, x: torch.Tensor, timestep: torch.Tensor, cond: FluxConditioning, guidance_scale: float,
                context: torch.Tensor | None = None, context_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The transformer's output over the target's packed tokens, unpacked; `context`: packed
        tokens it reads after them with their ids (FLUX.1 Kontext's source image)."""
        b, c, h, w = x.shape
        t = timestep.reshape(-1).to(x.device, x.dtype)
        t = t.expand(b) if t.numel() == 1 else t
        guidance = (torch.full((b,), float(guidance_scale), device=x.device, dtype=torch.float32)
                    if self.transformer.config.guidance_embeds else None)
        packed = self.pipe._pack_latents(x, b, c, h, w)
        ids = self._image_ids(h, w, x.device, x.dtype)
        if context is not None:
            packed_all = torch.cat([packed, context.to(packed.dtype)], dim=1)
            ids = torch.cat([ids, context_ids.to(x.dtype)], dim=0)
        out = self.transformer(hidden_states=packed if context is None else packed_all, timestep=t / 1000,
                               guidance=guidance, pooled_projections=cond.pooled,
                               encoder_hidden_states=cond.prompt_embeds, txt_ids=cond.text_ids, img_ids=ids,
                               return_dict=False)[0][:, :packed.shape[1]]
        vsf = self.pipe.vae_scale_factor
        return self.pipe._unpack_latents(out, h * vsf, w * vsf, vsf)

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random FLUX.1-dev-shaped pipeline of the family's class (guidance embedding, 16 packed channels, CLIP + T5,
        dynamic-shift scheduler) with tiny widths, saved with `save_pretrained`. Returns the
        overrides that run it (`model.resolution`: 32 px)."""
        import diffusers
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

        from .tiny_parts import clip_text_model, clip_tokenizer, image_vae, t5_encoder, t5_tokenizer

        torch.manual_seed(seed)
        build = out_dir.parent / (out_dir.name + "_build")
        tok, tok2 = clip_tokenizer(build / "tokenizer"), t5_tokenizer(build / "tokenizer_2", 64)
        te, te2 = clip_text_model(tok), t5_encoder(tok2)
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                             attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(2, 2, 4))
        vae = image_vae(latent_channels=4, scaling_factor=0.3611, shift_factor=0.1159)
        sched = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
        pipe = getattr(diffusers, cls.pipeline_class)(scheduler=sched, vae=vae, text_encoder=te, tokenizer=tok, text_encoder_2=te2,
                            tokenizer_2=tok2, transformer=transformer)
        pipe.save_pretrained(str(out_dir), safe_serialization=True)
        import shutil

        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32,
                "model.max_sequence_length": 64}
