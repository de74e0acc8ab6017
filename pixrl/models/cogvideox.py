"""CogVideoX text-to-video (2B, 5B, 1.5-5B): diffusers CogVideoXTransformer3DModel (an expert-
adaLN DiT over the T5 tokens and 2×2 — 1.5: 2×2×2 — patches of 16-channel latents; sinusoidal or,
from 5B, 3-D rotary positions), AutoencoderKLCogVideoX (×4 in time, ×8 in space), T5-XXL padded to
226 tokens, and a v-prediction DDPM schedule whose SNR is shifted (`snr_shift_scale`) and rescaled
to zero at the last step (CogVideoXDDIMScheduler, `trailing` spacing).

Everything about the variance-preserving process is the sd15 family's (`SD15Family`): the DDIM
grid as flow noise levels (here from σ = 1 exactly: zero terminal SNR), the flow velocity of the
model's v, DDPO's DDIM-η step, the DDPM timesteps and prediction error of DPO. The ᾱ table is
CogVideoXDDIMScheduler's (its SNR shift), whatever scheduler the checkpoint ships: the 2B ships
that DDIM, and the ODE equals CogVideoXPipeline's; the 5B ships CogVideoXDPMScheduler (a multistep
solver without a per-step density), whose grid rollouts step with DDIM instead — as SANA's.

What is CogVideoX's own: latents kept in the pipeline's frame-major layout [F, C, H, W] (its noise
is drawn in that order), the transformer's rotary table from the pipeline, CFG on one [negative;
prompt] batch as the pipeline does, and for 1.5 (`patch_size_t` 2) the latent frames padded to a
multiple of 2 with the padding dropped before decoding, as the pipeline does. `model.dynamic_cfg`
is the pipeline's `use_dynamic_cfg` (CogVideoX's official scripts sample with it): step k's scale
1 + g·(1 − cos(π·((T − t_k)/T)⁵))/2, as the pipeline computes it — from the step's *timestep* t_k
(999, …), not its index, so the base is negative and the scale oscillates along the grid; pixrl
reproduces it exactly (ODE = the pipeline's) rather than the evident intent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .base import ModelLoadError
from .pipelines import encodes_text
from .registry import register_family
from .sd15 import SD15Family
from .wan import video_to_uint8

__all__ = ["CogVideoXConditioning", "CogVideoXFamily"]


@dataclass
class CogVideoXConditioning:
    """T5 states padded to `max_sequence_length` (no mask: the transformer reads every token)."""

    prompt_embeds: torch.Tensor  # [B, 226, 4096]

    def select(self, idx) -> "CogVideoXConditioning":
        return CogVideoXConditioning(self.prompt_embeds[idx])

    def expand(self, n: int) -> "CogVideoXConditioning":
        return CogVideoXConditioning(self.prompt_embeds.expand(n, -1, -1))


@register_family("cogvideox")
class CogVideoXFamily(SD15Family):
    name = "cogvideox"
    pipeline_class = "CogVideoXPipeline"
    denoiser = "transformer"
    ddim_class = "CogVideoXDDIMScheduler"
    video = True
    text_tokens = (1, 226)  # T5 tokens: the transformer's max_text_seq_length (the pipeline's 226)
    # the attention projections (diffusers' CogVideoX LoRA training targets)
    lora_targets = ["to_k", "to_q", "to_v", "to_out.0"]
    default_frames = 49  # the pipeline's num_frames (1.5 checkpoints: 81)
    decode_batch = 1  # clips per VAE decode: a clip's activations are gigabytes

    options = {"dynamic_cfg": "the pipeline's use_dynamic_cfg: a guidance scale that changes along the grid"}

    def __init__(self, *args, dynamic_cfg: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.dynamic_cfg = bool(dynamic_cfg)
        self.set_clip_frames(self.pipe.vae_scale_factor_temporal)
        self._rotary: dict[torch.device, tuple[torch.Tensor, torch.Tensor] | None] = {}

    @classmethod
    def load(cls, path: str | Path, dtype: str = "float32", device: str = "cpu", max_sequence_length: int = 226,
             resolution: int | tuple | None = None, frames: int | None = None, trainable_device: str | None = None,
             text_towers: bool = True, **options) -> "CogVideoXFamily":
        return super().load(path, dtype, device, max_sequence_length, resolution, frames, trainable_device,
                            text_towers, **options)

    @staticmethod
    def default_resolution(pipe) -> tuple[int, int]:
        c, f = pipe.transformer.config, pipe.vae_scale_factor_spatial
        return c.sample_height * f, c.sample_width * f  # 480×720 (1.5: 768×1360)

    @staticmethod
    def resolution_multiple(pipe) -> int:
        return pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size

    def check_size(self) -> None:
        """Also: a transformer with learned positional embeddings (CogVideoX-5B-I2V) holds one size,
        its default; the pipeline refuses any other mid-sampling, the family at load."""
        super().check_size()
        c = self.transformer.config
        native = self.default_resolution(self.pipe)
        if c.use_learned_positional_embeddings and (self.height, self.width) != native:
            raise ModelLoadError(f"{self.size_setting()}: {self.path!r} (as CogVideoX-5B-I2V) has learned positional "
                                 f"embeddings for {native[0]}×{native[1]} clips only; set model.height={native[0]} "
                                 f"model.width={native[1]} (or unset the size), or use a checkpoint with rotary "
                                 "positions (CogVideoX1.5) for other sizes")

    def describe(self) -> dict:
        return {**super().describe(), "frames": self.frames, "dynamic_cfg": self.dynamic_cfg,
                "snr_shift_scale": self.ddim.config.snr_shift_scale,
                "zero_terminal_snr": bool(self.ddim.config.rescale_betas_zero_snr)}

    def guidance_schedule(self, scale: float, timestep, steps: int) -> float:
        """The guidance scale at a step: `scale`, or with model.dynamic_cfg the pipeline's
        1 + g·(1 − cos(π·((T − t)/T)⁵))/2 of the step's timestep t (its arithmetic, in Python floats)."""
        if not self.dynamic_cfg:
            return scale
        return 1 + scale * ((1 - math.cos(math.pi * ((steps - float(timestep)) / steps) ** 5.0)) / 2)

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> CogVideoXConditioning:
        return self.encode_text(prompts)

    def encode_text(self, prompts: list[str]) -> CogVideoXConditioning:
        """The pipeline's `encode_prompt` (T5 padded to max length); towers resident."""
        embeds, _ = self.pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length, device=self.device)
        return CogVideoXConditioning(embeds)

    # --- shapes -------------------------------------------------------------------------------
    def _latent_frames(self) -> tuple[int, int]:
        """(latent frames as the transformer reads them, the padding in front): 1.5's temporal
        patch needs a multiple of `patch_size_t`, which the pipeline pads to."""
        frames = (self.frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        p_t = self.transformer.config.patch_size_t
        pad = (p_t - frames % p_t) % p_t if p_t else 0
        return frames + pad, pad

    def latent_shape(self) -> tuple[int, int, int, int]:
        """[F', C, H', W']: the pipeline's frame-major layout."""
        h, w = self.latent_grid(self.pipe.vae_scale_factor_spatial)
        return self._latent_frames()[0], self.transformer.config.in_channels, h, w

    # --- the transformer's v ------------------------------------------------------------------
    def _rotary_table(self, device: torch.device):
        """The pipeline's 3-D rotary table for the clip (None when the checkpoint has none)."""
        if device not in self._rotary:
            table = None
            if self.transformer.config.use_rotary_positional_embeddings:
                table = self.pipe._prepare_rotary_positional_embeddings(self.height, self.width,
                                                                        self._latent_frames()[0], device)
            self._rotary[device] = table
        return self._rotary[device]

    def unet_output(self, x_t: torch.Tensor, t: torch.Tensor, *conds: CogVideoXConditioning) -> torch.Tensor:
        """The transformer's v (fp32) for x_t [B, F, C, H, W], the rows of `conds` stacked in order."""
        dtype = self.transformer.dtype
        embeds = torch.cat([c.prompt_embeds for c in conds]).to(dtype)
        return self.transformer(hidden_states=x_t.to(dtype), encoder_hidden_states=embeds, timestep=t,
                                image_rotary_emb=self._rotary_table(x_t.device), return_dict=False)[0].float()

    # --- pixels -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [B, F', C, H', W'] → uint8 clips [B, F, H, W, 3]: the padding frames dropped,
        channels first, unscaled, decoded one clip at a time (the pipeline's `decode_latents`)."""
        pad = self._latent_frames()[1]
        z = latents[:, pad:].permute(0, 2, 1, 3, 4).to(self.vae.dtype) / self.vae.config.scaling_factor
        return np.concatenate([video_to_uint8(self.vae.decode(c[None]).sample) for c in z])

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0, **transformer) -> dict:
        """A random CogVideoX-5B-shaped pipeline (T5 with a SentencePiece-Unigram tokenizer, the
        video VAE ×4 in time and in space, a 2-block DiT with 3-D rotary positions — `transformer`:
        further config, e.g. CogVideoX-2B's sinusoidal positions or 1.5's temporal patch — and
        CogVideoX-2B's scheduler: v-prediction, SNR shift 3, zero terminal SNR, trailing DDIM) with
        tiny widths. Returns the overrides that run it (32 px, 9 frames: 3 × 4 × 8 × 8 latents)."""
        import shutil

        from diffusers import (AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline,
                               CogVideoXTransformer3DModel)

        from .tiny_parts import t5_encoder, t5_tokenizer

        torch.manual_seed(seed)
        build = out_dir.parent / (out_dir.name + "_build")
        tok = t5_tokenizer(build / "tokenizer", 226)
        vae = AutoencoderKLCogVideoX(block_out_channels=(8, 8, 16), down_block_types=("CogVideoXDownBlock3D",) * 3,
                                     up_block_types=("CogVideoXUpBlock3D",) * 3, latent_channels=4, layers_per_block=1,
                                     norm_num_groups=4, temporal_compression_ratio=4, scaling_factor=0.7)
        dit = CogVideoXTransformer3DModel(**{
            **dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=16,
                   text_embed_dim=32, num_layers=2, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
                   max_text_seq_length=64, use_rotary_positional_embeddings=True), **transformer})
        sched = CogVideoXDDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                       clip_sample=False, prediction_type="v_prediction", rescale_betas_zero_snr=True,
                                       set_alpha_to_one=True, snr_shift_scale=3.0, timestep_spacing="trailing")
        CogVideoXPipeline(tokenizer=tok, text_encoder=t5_encoder(tok), vae=vae, transformer=dit,
                          scheduler=sched).save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32, "model.frames": 9,
                "model.max_sequence_length": 64}
