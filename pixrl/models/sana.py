"""SANA family: diffusers SanaTransformer2DModel (linear-attention DiT, cross-attention to the
text) + AutoencoderDC (deep-compression autoencoder, ×32, 32 channels) + a Gemma-2 text encoder
+ the checkpoint's flow-matching scheduler (DPMSolverMultistep with flow sigmas and
`flow_shift`, as the SANA checkpoints ship it).

Loads any directory in the diffusers SanaPipeline layout and reuses the pipeline's own
`encode_prompt` with its default "complex human instruction" prefix (the pipeline's `__call__`
prepends it; the kept tokens are BOS + the last `max_sequence_length − 1`), so conditioning is
what the pipeline computes. Latents are the transformer's own [C, H, W] (no packing).

Sampling: rollouts step the σ grid of the checkpoint's scheduler with the shared Euler/SDE
kernels (the pipeline's second-order multistep update has no per-step Gaussian transition, so it
cannot carry a log-prob; flow_grpo samples every family this way). The transformer is fed the
scheduler's timesteps exactly as the pipeline feeds them (DPMSolver rounds them to integers).
Guidance is classifier-free on one [negative; positive] batch, as the pipeline computes it; the
negative prompt is encoded without the instruction prefix, as the pipeline encodes it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .pipelines import PipelineFamily, encodes_text, pixels_to_uint8, scheduler_grid, unit_range
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime

__all__ = ["SanaConditioning", "SanaFamily"]


@dataclass
class SanaConditioning:
    """Gemma-2 hidden states of the prompts and their attention mask (right-padded)."""

    prompt_embeds: torch.Tensor  # [B, L, D]
    mask: torch.Tensor  # [B, L]

    def select(self, idx) -> "SanaConditioning":
        return SanaConditioning(self.prompt_embeds[idx], self.mask[idx])

    def expand(self, n: int) -> "SanaConditioning":
        return SanaConditioning(self.prompt_embeds.expand(n, -1, -1), self.mask.expand(n, -1))


@register_family("sana")
class SanaFamily(PipelineFamily):
    name = "sana"
    pipeline_class = "SanaPipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    guidance = "cfg"
    text_tokens = (2, 1024)  # the pipeline keeps BOS + the last L−1 tokens; SANA trains with 300
    # both attentions' projections (linear self-attention, cross-attention to the text), the
    # modules diffusers' SANA LoRA loader and training script adapt
    lora_targets = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"]

    @staticmethod
    def default_resolution(pipe) -> int:
        return pipe.transformer.config.sample_size * pipe.vae_scale_factor

    @staticmethod
    def resolution_multiple(pipe) -> int:
        return pipe.vae_scale_factor * pipe.transformer.config.patch_size

    def describe(self) -> dict:
        c = self.scheduler.config
        return {"resolution": [self.height, self.width], "shift": c.get("flow_shift", c.get("shift")),
                "scheduler": type(self.scheduler).__name__, "guidance": self.guidance}

    # --- conditioning -------------------------------------------------------------------------
    def _instruction(self) -> list[str]:
        """The prefix the pipeline's `__call__` prepends by default (SANA's prompt enhancer text)."""
        return inspect.signature(type(self.pipe).__call__).parameters["complex_human_instruction"].default

    def encode_prompts(self, prompts: list[str]) -> SanaConditioning:
        return self._encode(prompts, self._instruction())

    def encode_negative(self, text: str) -> SanaConditioning:
        """The pipeline encodes its negative prompt without the instruction prefix."""
        return self._encode([text], None)

    @encodes_text
    @torch.no_grad()
    def _encode(self, prompts: list[str], instruction: list[str] | None) -> SanaConditioning:
        embeds, mask, _, _ = self.pipe.encode_prompt(
            prompts, do_classifier_free_guidance=False, device=self.device, clean_caption=False,
            max_sequence_length=self.max_sequence_length, complex_human_instruction=instruction)
        return SanaConditioning(embeds, mask)

    # --- dynamics -----------------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int]:
        h, w = self.latent_grid(self.pipe.vae_scale_factor)
        return self.transformer.config.in_channels, h, w

    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(σ [T+1] ending at 0, timesteps [T]) as the checkpoint's scheduler sets them for the pipeline."""
        return scheduler_grid(self.scheduler, steps, self.device, self.name, self.path)

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: SanaConditioning,
                 guidance_scale: float = 1.0, neg: SanaConditioning | None = None) -> torch.Tensor:
        """v_θ(x, t | c) on latents [B, C, H, W]; guidance_scale > 1: CFG on one [neg; pos] batch."""
        b = x.shape[0]
        t = timestep.reshape(-1).to(x.device)
        t = (t.expand(b) if t.numel() == 1 else t) * self.transformer.config.timestep_scale
        if guidance_scale > 1.0:
            if neg is None:
                raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
            out = self._predict(torch.cat([x, x]), torch.cat([t, t]), torch.cat([neg.prompt_embeds, cond.prompt_embeds]),
                                torch.cat([neg.mask, cond.mask]))
            v_u, v_c = out.chunk(2)
            return v_u + guidance_scale * (v_c - v_u)
        return self._predict(x, t, cond.prompt_embeds, cond.mask)

    def _predict(self, x, t, embeds, mask) -> torch.Tensor:
        dtype = self.transformer.dtype
        out = self.transformer(x.to(dtype), encoder_hidden_states=embeds.to(dtype), encoder_attention_mask=mask,
                               timestep=t, return_dict=False)[0].float()
        if self.transformer.config.out_channels // 2 == x.shape[1]:  # learned σ: keep the mean
            out = out.chunk(2, dim=1)[0]
        return out

    # --- pixels -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents → uint8 [B, H, W, 3]: `decode_pixels`, quantised."""
        return pixels_to_uint8(self.decode_pixels(latents))

    def decode_pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents → images [B, 3, H, W] in [0, 1], differentiable: the DC-AE decode of
        latents / scaling_factor."""
        z = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
        return unit_range(self.vae.decode(z, return_dict=False)[0])

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random SANA-shaped pipeline (Gemma-2 encoder with a Gemma BPE tokenizer that keeps the
        instruction prefix's words whole, DC-AE, linear-attention DiT, DPMSolver with flow sigmas and
        flow_shift 3 as SANA ships) with tiny widths. Returns the overrides that run it (32 px)."""
        import re
        import shutil

        from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel

        from .tiny_parts import gemma2_text_encoder, gemma_tokenizer

        torch.manual_seed(seed)
        build = out_dir.parent / (out_dir.name + "_build")
        instruction = inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default
        tok = gemma_tokenizer(build / "tokenizer", re.findall(r"[A-Za-z]+", " ".join(instruction)))
        text_encoder = gemma2_text_encoder(tok)
        z = 4
        vae = AutoencoderDC(in_channels=3, latent_channels=z, attention_head_dim=8,
                            encoder_block_types=("ResBlock", "EfficientViTBlock"),
                            decoder_block_types=("ResBlock", "EfficientViTBlock"),
                            encoder_block_out_channels=(8, 16), decoder_block_out_channels=(8, 16),
                            encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
                            encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
                            scaling_factor=0.41407)
        transformer = SanaTransformer2DModel(in_channels=z, out_channels=z, num_attention_heads=2, attention_head_dim=8,
                                             num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=8,
                                             cross_attention_dim=16, caption_channels=32, sample_size=16)
        sched = DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint",
                                            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                            lower_order_final=True)
        SanaPipeline(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer,
                     scheduler=sched).save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32,
                "model.max_sequence_length": 64}
