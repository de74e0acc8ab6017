"""SD3 / SD3.5 family: diffusers SD3Transformer2DModel + AutoencoderKL +
FlowMatchEulerDiscreteScheduler + CLIP (×2) and optional T5 text encoders.

Loads any directory in the diffusers StableDiffusion3Pipeline layout (a real SD3.5 checkout
or the embedded miniature) through `from_pretrained`, and reuses the pipeline's own
`encode_prompt` so conditioning is exactly what the pipeline computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .base import ModelLoadError, torch_dtype
from .pipelines import SIGMAS_OPTION, PipelineFamily, dynamic_shift_mu, encodes_text
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime

__all__ = ["SD3Conditioning", "SD3Family", "ModelLoadError", "torch_dtype"]


@dataclass
class SD3Conditioning:
    """SD3's text conditioning for a batch: per-token embeddings (CLIP ×2 [+ T5]) and pooled CLIP."""

    prompt_embeds: torch.Tensor  # [B, L, D]
    pooled: torch.Tensor  # [B, P]

    def select(self, idx) -> "SD3Conditioning":
        return SD3Conditioning(self.prompt_embeds[idx], self.pooled[idx])

    def expand(self, n: int) -> "SD3Conditioning":
        """Broadcast a batch-1 conditioning (e.g. the negative prompt) to n rows."""
        return SD3Conditioning(self.prompt_embeds.expand(n, -1, -1), self.pooled.expand(n, -1))


@register_family("sd3")
class SD3Family(PipelineFamily):
    """A loaded SD3-style model: what the shared denoise sampler and the trainer need."""

    name = "sd3"
    options = SIGMAS_OPTION
    pipeline_class = "StableDiffusion3Pipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    # flow_grpo's LoRA targets for SD3 (attention projections of both streams)
    lora_targets = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0"]

    guidance = "cfg"  # guidance_scale > 1: classifier-free guidance on one [negative; positive] batch

    text_tokens = (0, 512)  # T5 tokens; 0: no T5 (SD3 zero-pads, as the miniature runs)

    @classmethod
    def load(cls, path: str | Path, dtype: str = "float32", device: str = "cpu",
             max_sequence_length: int = 256, resolution: int | tuple | None = None, frames: int | None = None,
             trainable_device: str | None = None, text_towers: bool = True, **options) -> "SD3Family":
        return super().load(path, dtype, device, max_sequence_length, resolution, frames, trainable_device,
                            text_towers, **options)

    @staticmethod
    def resolution_multiple(pipe) -> int:
        return pipe.vae_scale_factor * pipe.transformer.config.patch_size

    def check_size(self) -> None:
        """Also: each side within the positional table the transformer crops from (SD3's
        `pos_embed_max_size` patches: 192 × 16 px for SD3.5, which would fail mid-rollout)."""
        super().check_size()
        cells = self.transformer.config.get("pos_embed_max_size")
        largest = cells * self.transformer.config.patch_size * self.pipe.vae_scale_factor if cells else None
        if largest and max(self.height, self.width) > largest:
            raise ModelLoadError(f"{self.size_setting()}: this checkpoint's positional table covers {largest}px a "
                                 f"side ({cells} patches); set each side to at most {largest}")

    def describe(self) -> dict:
        return {"resolution": list(self.latent_shape()), "shift": self.scheduler.config.get("shift")}

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> SD3Conditioning:
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length, device=self.transformer.device)
        return SD3Conditioning(embeds, pooled)

    # --- dynamics -----------------------------------------------------------------------------
    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigmas [T+1] ending at 0, timesteps [T]) exactly as the pipeline sets them."""
        from copy import deepcopy

        sched = deepcopy(self.scheduler)
        kwargs = {}
        if sched.config.get("use_dynamic_shifting", False):
            _, h, w = self.latent_shape()
            patch = self.transformer.config.patch_size
            kwargs["mu"] = dynamic_shift_mu(sched, (h // patch) * (w // patch), max_shift=1.16)
        if self.sigmas is None:
            sched.set_timesteps(steps, device=self.device, **kwargs)
        else:  # model.sigmas, as the pipeline's `sigmas=`
            sched.set_timesteps(sigmas=self.grid_sigmas(steps, None), device=self.device, **kwargs)
        return sched.sigmas.float().clone(), sched.timesteps.float().clone()

    def latent_shape(self) -> tuple[int, int, int]:
        h, w = self.latent_grid(self.pipe.vae_scale_factor)
        return self.transformer.config.in_channels, h, w

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: SD3Conditioning,
                 guidance_scale: float = 1.0, neg: SD3Conditioning | None = None) -> torch.Tensor:
        """v_θ(x, t | c); with guidance_scale > 1 the pipeline's CFG on one [neg; pos] batch."""
        b = x.shape[0]
        t = timestep.reshape(-1).to(x.device)
        t = t.expand(b) if t.numel() == 1 else t
        if guidance_scale > 1.0:
            if neg is None:
                raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
            out = self.transformer(hidden_states=torch.cat([x, x]), timestep=torch.cat([t, t]),
                                   encoder_hidden_states=torch.cat([neg.prompt_embeds, cond.prompt_embeds]),
                                   pooled_projections=torch.cat([neg.pooled, cond.pooled]), return_dict=False)[0]
            v_u, v_c = out.chunk(2)
            return v_u + guidance_scale * (v_c - v_u)
        return self.transformer(hidden_states=x, timestep=t, encoder_hidden_states=cond.prompt_embeds,
                                pooled_projections=cond.pooled, return_dict=False)[0]

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random SD3-architecture pipeline (two CLIP towers, no T5) with tiny widths, saved with
        `save_pretrained`; the same builder as the embedded miniature's. Returns its overrides."""
        from .mini.build import MiniSpec, build_random_checkpoint

        spec = MiniSpec(image_size=16, vae_channels=(8, 16), latent_channels=4, text_hidden=16, text_layers=2,
                        num_layers=1, heads=2, head_dim=16)
        build_random_checkpoint(out_dir, spec, seed=seed)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.max_sequence_length": 0}
