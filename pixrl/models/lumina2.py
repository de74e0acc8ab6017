"""Lumina-Image 2.0 (Alpha-VLLM): diffusers' Lumina2Transformer2DModel (a unified next-DiT over
the image's 2×2 patches and the caption's tokens, with caption and noise refiners and 3-axis
RoPE), a Gemma-2 text encoder, the FLUX.1 VAE (16 channels, scale and shift) and a flow-matching
Euler schedule, as Lumina2Pipeline computes them:

- captions: the penultimate hidden states of the system prompt + " <Prompt Start> " + the prompt,
  padded to `max_sequence_length`, with their attention mask; CFG's negative prompt
  (`sampling.negative_prompt`, empty by default) is encoded bare, as the pipeline encodes it;
- time: the transformer reads t_L = 1 − σ (Lumina's t = 0 is noise) and predicts −v, so the
  velocity is the negated output;
- CFG: v_u + s·(v_c − v_u) from two passes, then (`model.cfg_normalization`, the pipeline's
  default) rescaled to the conditional output's norm along the last axis. The pipeline's
  `cfg_trunc_ratio` (guidance only on the first part of the steps) is a position on the
  sampling grid, which a velocity call does not know: not offered (its default, 1, is off);
- σ grid: `linspace(1, 1/T, T)` with the scheduler's shift (the pipeline's μ reads the latents'
  channel count as the sequence length; the shipped scheduler's static shift ignores μ).

Latents stay [C, H/8, W/8] (the transformer patchifies them itself).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .pipelines import SIGMAS_OPTION, PipelineFamily, dynamic_shift_mu, encodes_text, packed_grid
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime

__all__ = ["Lumina2Conditioning", "Lumina2Family"]


@dataclass
class Lumina2Conditioning:
    """Gemma-2 states of each caption (padded) and its attention mask."""

    prompt_embeds: torch.Tensor  # [B, L, D]
    attention_mask: torch.Tensor  # [B, L]

    def select(self, idx) -> "Lumina2Conditioning":
        return Lumina2Conditioning(self.prompt_embeds[idx], self.attention_mask[idx])

    def expand(self, n: int) -> "Lumina2Conditioning":
        return Lumina2Conditioning(self.prompt_embeds.expand(n, -1, -1), self.attention_mask.expand(n, -1))


@register_family("lumina2")
class Lumina2Family(PipelineFamily):
    name = "lumina2"
    pipeline_class = "Lumina2Pipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    guidance = "cfg"
    cfg_truncation_by = "step"  # sampling.cfg_truncation as Lumina2Pipeline's cfg_trunc_ratio: (k + 1)/steps
    text_tokens = (1, 1024)  # the pipeline's 256 by default
    options = {**SIGMAS_OPTION,
               "cfg_normalization": "rescale the guided output to the conditional output's norm (the pipeline's "
                                    "default: true)"}
    # diffusers' Lumina2 LoRA training targets (train_dreambooth_lora_lumina2.py)
    lora_targets = ["to_k", "to_q", "to_v", "to_out.0"]

    def __init__(self, pipe, *args, cfg_normalization: bool = True, **kwargs):
        super().__init__(pipe, *args, **kwargs)
        self.cfg_normalization = bool(cfg_normalization)

    def describe(self) -> dict:
        return {**super().describe(), "cfg_normalization": self.cfg_normalization}

    # --- conditioning -------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str]) -> Lumina2Conditioning:
        """The pipeline's captions: the system prompt before each prompt."""
        return self._encode([f"{self.pipe.system_prompt} <Prompt Start> {p}" for p in prompts])

    def encode_negative(self, text: str) -> Lumina2Conditioning:
        """The pipeline encodes its negative prompt bare (no system prompt)."""
        return self._encode([text])

    @encodes_text
    @torch.no_grad()
    def _encode(self, texts: list[str]) -> Lumina2Conditioning:
        embeds, mask = self.pipe._get_gemma_prompt_embeds(texts, device=self.device,
                                                           max_sequence_length=self.max_sequence_length)
        return Lumina2Conditioning(embeds, mask)

    # --- dynamics -----------------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int]:
        h, w = packed_grid(self.height, self.width, self.pipe.vae_scale_factor)
        return self.transformer.config.in_channels, h, w

    def _mu(self) -> float:
        """The pipeline's μ: calculate_shift of `latents.shape[1]`, which is the channel count."""
        return dynamic_shift_mu(self.scheduler, self.transformer.config.in_channels)

    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        from copy import deepcopy

        sched = deepcopy(self.scheduler)
        sigmas = self.grid_sigmas(steps, np.linspace(1.0, 1 / steps, steps))
        sched.set_timesteps(sigmas=sigmas, device=self.device, mu=self._mu())
        return sched.sigmas.float().clone(), sched.timesteps.float().clone()

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: Lumina2Conditioning,
                 guidance_scale: float = 1.0, neg: Lumina2Conditioning | None = None) -> torch.Tensor:
        """v_θ(x, t | c) on latents [B, C, H, W]: the negated (guided, renormalised) output at 1 − t/T."""
        b = x.shape[0]
        t = timestep.reshape(-1).to(x.device, torch.float32)
        t = 1 - (t.expand(b) if t.numel() == 1 else t) / self.scheduler.config.num_train_timesteps
        out = self._forward(x, t, cond)
        if guidance_scale > 1.0:
            if neg is None:
                raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
            cond_out = out
            uncond = self._forward(x, t, neg)
            out = uncond + guidance_scale * (cond_out - uncond)
            if self.cfg_normalization:
                out = out * (torch.norm(cond_out, dim=-1, keepdim=True) / torch.norm(out, dim=-1, keepdim=True))
        return -out

    def _forward(self, x: torch.Tensor, t: torch.Tensor, cond: Lumina2Conditioning) -> torch.Tensor:
        tr = self.transformer
        return tr(hidden_states=x.to(tr.dtype), timestep=t.to(tr.dtype), encoder_hidden_states=cond.prompt_embeds,
                  encoder_attention_mask=cond.attention_mask, return_dict=False)[0].float()

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random Lumina-Image-2.0-shaped pipeline: a tiny Gemma-2 with a Gemma BPE tokenizer that
        keeps the system prompt's words whole, a 2-layer next-DiT with its refiners (3-axis RoPE), a
        4-channel FLUX-style VAE (scale and shift, 8× down as the pipeline assumes), Lumina's scheduler
        (static shift 6). Returns the overrides that run it (64 px)."""
        import shutil

        from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

        from .tiny_parts import gemma2_text_encoder, gemma_tokenizer, image_vae

        torch.manual_seed(seed)
        build = out_dir.parent / (out_dir.name + "_build")
        system = Lumina2Pipeline(transformer=None, scheduler=None, vae=None, text_encoder=None, tokenizer=None)
        words = re.findall(r"[A-Za-z]+", system.system_prompt)  # kept whole: the caption fits in 128 tokens
        tok = gemma_tokenizer(build / "tokenizer", words + ["Prompt", "Start"])
        text_encoder = gemma2_text_encoder(tok)
        transformer = Lumina2Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, hidden_size=32,
                                                num_layers=2, num_refiner_layers=1, num_attention_heads=2,
                                                num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6),
                                                axes_lens=(300, 64, 64), cap_feat_dim=32)
        # the pipeline fixes its VAE factor at 8: four levels of blocks
        vae = image_vae(latent_channels=4, channels=(8, 8, 16, 16), scaling_factor=0.3611, shift_factor=0.1159)
        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=6.0)
        Lumina2Pipeline(transformer=transformer, scheduler=sched, vae=vae, text_encoder=text_encoder,
                        tokenizer=tok).save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 64,
                "model.max_sequence_length": 128}
