"""Mochi 1 text-to-video: diffusers MochiTransformer3DModel (an asymmetric DiT — a wide visual
stream beside a narrower text one — over 2×2 patches of 12-channel latents), AutoencoderKLMochi
(×6 in time, ×8 in space, per-channel latent mean/std), a T5-XXL text encoder with its attention
mask, and MochiPipeline's schedule: genmo's linear-quadratic σ list (half the steps linear down to
σ 0.975, the rest quadratic to 0), given to a flow-matching Euler scheduler with `invert_sigmas`.

Mochi's time runs backwards: its transformer reads t = (1 − σ)·1000 and predicts the direction
from noise to data, so pixrl's velocity (noise minus data, σ from 1 to 0) is the negated output
and the σ grid the scheduler's inverted back. CFG is the pipeline's (`uncond + s·(cond − uncond)`,
in float32). With `force_zeros_for_empty_prompt` (model_index.json) an empty prompt is encoded as
genmo's reference does — no tokens, an all-false mask; the pipeline tests only the last prompt of
a batch for it, pixrl each prompt (what the pipeline gives one prompt a call). Clips have
`model.frames` frames (6k+1; the pipeline's 19 by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .pipelines import PipelineFamily, encodes_text
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime
from .wan import video_to_uint8

__all__ = ["MochiConditioning", "MochiFamily", "THRESHOLD_NOISE"]

THRESHOLD_NOISE = 0.025  # the pipeline's linear-quadratic schedule: linear steps end at σ = 1 − 0.025


@dataclass
class MochiConditioning:
    """T5 states padded to `max_sequence_length` with their attention mask, as the pipeline encodes."""

    prompt_embeds: torch.Tensor  # [B, L, 4096]
    mask: torch.Tensor  # [B, L] bool

    def select(self, idx) -> "MochiConditioning":
        return MochiConditioning(self.prompt_embeds[idx], self.mask[idx])

    def expand(self, n: int) -> "MochiConditioning":
        return MochiConditioning(self.prompt_embeds.expand(n, -1, -1), self.mask.expand(n, -1))


@register_family("mochi")
class MochiFamily(PipelineFamily):
    name = "mochi"
    pipeline_class = "MochiPipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    guidance = "cfg"
    video = True
    text_tokens = (1, 256)  # T5 tokens: the transformer's max_sequence_length (the pipeline's 256)
    # the attention projections of both streams' joint attention in every block
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]
    default_frames = 19  # the pipeline's num_frames
    decode_batch = 1  # clips per VAE decode: a 480p clip's activations are gigabytes

    def __init__(self, pipe, *args, **kwargs):
        super().__init__(pipe, *args, **kwargs)
        self.inverted = bool(self.scheduler.config.get("invert_sigmas", False))
        self.set_clip_frames(pipe.vae_temporal_scale_factor)

    @staticmethod
    def default_resolution(pipe) -> tuple[int, int]:
        return pipe.default_height, pipe.default_width  # 480×848

    @staticmethod
    def resolution_multiple(pipe) -> int:
        return pipe.vae_spatial_scale_factor * pipe.transformer.config.patch_size

    def describe(self) -> dict:
        return {"resolution": [self.height, self.width], "frames": self.frames, "guidance": self.guidance,
                "schedule": f"linear-quadratic (threshold {THRESHOLD_NOISE})", "time": "inverted" if self.inverted
                else "σ", "force_zeros_for_empty_prompt": bool(self.pipe.config.get("force_zeros_for_empty_prompt"))}

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> MochiConditioning:
        return self.encode_text(prompts)

    def encode_text(self, prompts: list[str]) -> MochiConditioning:
        """The pipeline's `encode_prompt` (T5 padded to max length, its mask kept), an empty prompt
        on its own (the pipeline zeroes a whole batch whose last prompt is empty); towers resident."""
        prompts = list(prompts)
        calls = [[i] for i, p in enumerate(prompts) if p == ""]
        rest = [i for i, p in enumerate(prompts) if p != ""]
        calls += [rest] if rest else []
        embeds, masks = [None] * len(prompts), [None] * len(prompts)
        for rows in calls:
            e, m, _, _ = self.pipe.encode_prompt([prompts[i] for i in rows], do_classifier_free_guidance=False,
                                                 max_sequence_length=self.max_sequence_length, device=self.device)
            for j, i in enumerate(rows):
                embeds[i], masks[i] = e[j], m[j]
        return MochiConditioning(torch.stack(embeds), torch.stack(masks))

    # --- dynamics -----------------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int, int]:
        h, w = self.latent_grid(self.pipe.vae_spatial_scale_factor)
        frames = (self.frames - 1) // self.pipe.vae_temporal_scale_factor + 1
        return self.transformer.config.in_channels, frames, h, w

    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(σ [T+1] ending at 0, timesteps [T] in the transformer's units) from the pipeline's
        linear-quadratic σ list set on the checkpoint's scheduler (which inverts it)."""
        from copy import deepcopy

        from diffusers.pipelines.mochi.pipeline_mochi import linear_quadratic_schedule

        sched = deepcopy(self.scheduler)
        sched.set_timesteps(sigmas=np.array(linear_quadratic_schedule(steps, THRESHOLD_NOISE)), device=self.device)
        sigmas = sched.sigmas.float().clone()
        return (1.0 - sigmas if self.inverted else sigmas), sched.timesteps.float().clone()

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: MochiConditioning,
                 guidance_scale: float = 1.0, neg: MochiConditioning | None = None) -> torch.Tensor:
        """v_θ(x, t | c) on video latents [B, C, F, H, W]: the transformer's output (negated when the
        checkpoint's time is inverted); guidance_scale > 1: the pipeline's CFG."""
        b = x.shape[0]
        t = timestep.reshape(-1).to(x.device)
        t = t.expand(b) if t.numel() == 1 else t
        u = self._predict(x, t, cond)
        if guidance_scale > 1.0:
            if neg is None:
                raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
            u_n = self._predict(x, t, neg)
            u = u_n + guidance_scale * (u - u_n)
        return -u if self.inverted else u

    def _predict(self, x: torch.Tensor, t: torch.Tensor, cond: MochiConditioning) -> torch.Tensor:
        dtype = self.transformer.dtype
        return self.transformer(hidden_states=x.to(dtype), encoder_hidden_states=cond.prompt_embeds.to(dtype),
                                timestep=t.to(dtype), encoder_attention_mask=cond.mask,
                                return_dict=False)[0].float()

    # --- pixels -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [B, C, F', H', W'] → uint8 clips [B, F, H, W, 3]: the latent mean/std (or
        scaling) undone as the pipeline does, decode."""
        cfg, vae = self.vae.config, self.vae
        z = latents.to(self.dtype)
        if cfg.get("latents_mean") is not None and cfg.get("latents_std") is not None:
            c = z.shape[1]
            mean = torch.tensor(cfg.latents_mean).view(1, c, 1, 1, 1).to(z.device, z.dtype)
            std = torch.tensor(cfg.latents_std).view(1, c, 1, 1, 1).to(z.device, z.dtype)
            z = z * std / cfg.scaling_factor + mean
        else:
            z = z / cfg.scaling_factor
        return video_to_uint8(vae.decode(z.to(vae.dtype), return_dict=False)[0])

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0, force_zeros: bool = True) -> dict:
        """A random Mochi-1-shaped pipeline (T5 with a SentencePiece-Unigram tokenizer, Mochi's VAE
        ×6 in time and ×8 in space with latent mean/std, a 2-block asymmetric DiT, the inverted
        Euler scheduler; empty prompts zeroed unless `force_zeros` is off) with tiny widths.
        Returns the overrides that run it (32 px, 7 frames: 2 × 4 × 4 latents)."""
        import shutil

        from diffusers import MochiPipeline

        build = out_dir.parent / (out_dir.name + "_build")
        MochiPipeline(**tiny_parts(build, seed), force_zeros_for_empty_prompt=force_zeros).save_pretrained(
            str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32, "model.frames": 7,
                "model.max_sequence_length": 32}


def tiny_parts(build: Path, seed: int) -> dict:
    """Seeded tiny Mochi components (see `write_tiny`)."""
    from diffusers import AutoencoderKLMochi, MochiTransformer3DModel

    from .tiny_parts import t5_encoder, t5_tokenizer

    torch.manual_seed(seed)
    tok = t5_tokenizer(build / "tokenizer", 256)
    text_encoder = t5_encoder(tok, d_model=32)
    vae = AutoencoderKLMochi(encoder_block_out_channels=(32,) * 4, decoder_block_out_channels=(32,) * 4,
                             layers_per_block=(1,) * 5, add_attention_block=(False,) * 5,
                             latents_mean=tuple(np.linspace(-0.1, 0.1, 12)), latents_std=tuple(np.linspace(0.8, 1.4, 12)))
    transformer = MochiTransformer3DModel(num_attention_heads=2, attention_head_dim=16, num_layers=2,
                                          pooled_projection_dim=16, text_embed_dim=32, time_embed_dim=16,
                                          max_sequence_length=32)
    return dict(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=mochi_scheduler())


def mochi_scheduler():
    """Mochi 1's scheduler (its released scheduler_config.json): flow-matching Euler, inverted σ, no shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(invert_sigmas=True, shift=1.0, use_dynamic_shifting=False)
