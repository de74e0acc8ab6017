"""Qwen-Image family: diffusers QwenImageTransformer2DModel (MMDiT, 2×2 packed latents) +
AutoencoderKLQwenImage (a causal video VAE used with one frame, per-channel latent mean/std) +
FlowMatchEulerDiscreteScheduler with dynamic shift + a Qwen2.5-VL text encoder (its last hidden
state under the pipeline's chat template, the template's tokens dropped).

Loads any directory in the diffusers QwenImagePipeline layout and reuses the pipeline's own
`encode_prompt`, packing and latent normalisation, so conditioning, velocity and decode are what
the pipeline computes. Latents are kept unpacked ([C, H, W]; the pipeline's single frame axis is
implicit). Guidance is the pipeline's "true CFG" (VeRL-Omni and flow_grpo train Qwen-Image with
CFG 4): a negative-prompt batch, then the combined prediction rescaled to the conditional one's
norm per packed token — done inside `velocity`, in packed space, as the pipeline does it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .pipelines import PackedLatentsFamily, encodes_text, pixels_to_uint8, unit_range
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime

__all__ = ["QwenImageConditioning", "QwenImageFamily"]


@dataclass
class QwenImageConditioning:
    """Qwen2.5-VL hidden states of the prompts (template dropped) and their padding mask."""

    prompt_embeds: torch.Tensor  # [B, L, D]
    mask: torch.Tensor | None  # [B, L]; None when no row is padded

    def select(self, idx) -> "QwenImageConditioning":
        return QwenImageConditioning(self.prompt_embeds[idx], None if self.mask is None else self.mask[idx])

    def expand(self, n: int) -> "QwenImageConditioning":
        return QwenImageConditioning(self.prompt_embeds.expand(n, -1, -1),
                                     None if self.mask is None else self.mask.expand(n, -1))


@register_family("qwen_image")
class QwenImageFamily(PackedLatentsFamily):
    name = "qwen_image"
    pipeline_class = "QwenImagePipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    guidance = "cfg"
    text_tokens = (1, 1024)  # the pipeline's limit; 512 by default
    # the MMDiT's attention projections of both streams (VeRL-Omni / DiffSynth Qwen-Image LoRA targets)
    lora_targets = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                    "attn.add_v_proj", "attn.to_add_out"]

    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> QwenImageConditioning:
        embeds, mask = self.pipe.encode_prompt(prompt=prompts, device=self.device,
                                               max_sequence_length=self.max_sequence_length)
        return QwenImageConditioning(embeds, mask)

    # --- dynamics -----------------------------------------------------------------------------
    def _predict(self, packed, t, cond: QwenImageConditioning, img_shapes) -> torch.Tensor:
        return self.transformer(hidden_states=packed, timestep=t / 1000, guidance=None,
                                encoder_hidden_states_mask=cond.mask, encoder_hidden_states=cond.prompt_embeds,
                                img_shapes=img_shapes, return_dict=False)[0]

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: QwenImageConditioning,
                 guidance_scale: float = 1.0, neg: QwenImageConditioning | None = None) -> torch.Tensor:
        """v_θ(x, t | c) on unpacked latents [B, C, H, W]; guidance_scale > 1: the pipeline's true
        CFG with the norm of the conditional prediction kept per packed token."""
        b, c, h, w = x.shape
        t = timestep.reshape(-1).to(x.device, x.dtype)
        t = t.expand(b) if t.numel() == 1 else t
        packed = self.pipe._pack_latents(x, b, c, h, w)
        shapes = [[(1, h // 2, w // 2)]] * b
        v = self._predict(packed, t, cond, shapes)
        if guidance_scale > 1.0:
            if neg is None:
                raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
            v_neg = self._predict(packed, t, neg, shapes)
            comb = v_neg + guidance_scale * (v - v_neg)
            v = comb * (torch.norm(v, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
        vsf = self.pipe.vae_scale_factor
        return self.pipe._unpack_latents(v, h * vsf, w * vsf, vsf)[:, :, 0]

    # --- pixels -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final (unpacked) latents → uint8 [B, H, W, 3]: `decode_pixels`, quantised."""
        return pixels_to_uint8(self.decode_pixels(latents))

    def decode_pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """Final (unpacked) latents → images [B, 3, H, W] in [0, 1], differentiable: the
        pipeline's de-normalisation, one-frame decode."""
        cfg = self.vae.config
        z = latents.to(self.vae.dtype).unsqueeze(2)
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        return unit_range(self.vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0])

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random Qwen-Image-shaped pipeline (Qwen2.5-VL text encoder with a byte-level BPE
        tokenizer and the chat tokens, causal VAE with latent mean/std, 2×2-packed MMDiT, dynamic
        shift) with tiny widths, saved with `save_pretrained`. Returns the overrides that run it."""
        from diffusers import QwenImagePipeline

        from .qwen_image_parts import qwen_image_core
        from .tiny_parts import qwen2_tokenizer, qwen25_vl_text_encoder

        torch.manual_seed(seed)
        build = out_dir.parent / (out_dir.name + "_build")
        tok = qwen2_tokenizer(build / "tokenizer")
        text_encoder = qwen25_vl_text_encoder(tok)
        vae, transformer, sched = qwen_image_core()
        QwenImagePipeline(scheduler=sched, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                          transformer=transformer).save_pretrained(str(out_dir), safe_serialization=True)
        import shutil

        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32,
                "model.max_sequence_length": 64}
