"""Cosmos-Predict2 text-to-image (NVIDIA, 2B and 14B; diffusers Cosmos2TextToImagePipeline): a
DiT (CosmosTransformer3DModel: adaLN-LoRA blocks, 3-D RoPE, a zero padding-mask channel) on the
Wan2.1 VAE's latents [C, 1, H/8, W/8], T5-11B prompt states (zeroed past each prompt's length, no
mask given to the transformer), over an EDM noise schedule. visual-rl trains Cosmos-Predict2.

The pipeline samples in EDM coordinates — x = x0 + σ·ε, σ from 80 down to 0.002 on a Karras grid
(ρ = 7) — with the preconditioning c_in = c_skip = 1 − t, c_out = −t at t = σ/(σ + 1). That is a
rectified flow in disguise: the flow latent (1 − t)·x is what the transformer reads, its output
F at time t is the flow velocity (D = x_flow − t·F is the data prediction), and the Euler step
in σ on x equals the Euler step in t on the flow latent exactly (both are the DDIM step from
D and ε̂). So pixrl steps the flow σ_flow = t with the shared kernels and hands the pipeline's
coordinates to the decoder: the first flow latent is t0·ε (the pipeline's 80·ε), the last is
divided by 1 − t_T (`latent_scales`). ODE sampling equals the pipeline's.

What is the family's own, as Cosmos2TextToImagePipeline computes it:
- the grid: Karras σ over the pipeline's step count, its last point repeated
  (`final_sigmas_type="sigma_min"`): the last step is a zero-length step at σ = 0.002 that moves
  nothing (its model evaluation is the pipeline's too). A stored or CPS-stochastic step there
  would have no distribution; preflight refuses it (`check_options`). The DPM-Solver tails
  (MixGRPO-Flash, DiffusionNFT) take it as the identity it is and end at σ_min too;
- CFG is `cond + w·(cond − uncond)` on the data prediction, the same on the velocity;
  pixrl's `sampling.guidance_scale` s is the usual one, so the pipeline's `guidance_scale` w is
  s − 1 (its 7.0 is s = 8). The pipeline turns CFG on only for w > 1; pixrl for s > 1;
- the negative prompt: the pipeline's own long default (`model/cosmos2_*` presets set it);
- the transformer's padding mask is zeros at the image size (resized to the latents' grid:
  diffusers resizes it with torchvision, which pixrl does not install — `padding_mask_resize`
  gives the transformer module the same nearest resize from torch);
- Cosmos Guardrail (the pipeline's `safety_checker`, package cosmos_guardrail) is not run:
  rollouts never go through the pipeline's `__call__`, as with every family. Its licence's
  guardrail terms remain the user's to meet.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .base import ModelLoadError
from .pipelines import PipelineFamily, encodes_text
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime
from .wan import video_to_uint8

__all__ = ["Cosmos2Conditioning", "Cosmos2Family", "decode_clips", "first_latent_frame", "padding_mask_resize",
           "prompt_conditioning", "without_guardrail"]


@dataclass
class Cosmos2Conditioning:
    """The prompts' text states [B, L, D] (Predict2: T5, zero past each prompt's length; 2.5: every
    Qwen2.5-VL layer normalised and concatenated) and, for the image-conditioned ones, each
    prompt's clean first latent frame (None for text alone and for the negative prompt, which
    borrows the rows' own)."""

    prompt_embeds: torch.Tensor
    condition: torch.Tensor | None = None  # [B, C, 1, H', W']

    def select(self, idx) -> "Cosmos2Conditioning":
        return Cosmos2Conditioning(self.prompt_embeds[idx], None if self.condition is None else self.condition[idx])

    def expand(self, n: int) -> "Cosmos2Conditioning":
        grow = (lambda v: None if v is None else v.expand(n, *v.shape[1:]))  # noqa: E731
        return Cosmos2Conditioning(grow(self.prompt_embeds), grow(self.condition))


def prompt_conditioning(family, prompts: list[str], images: list[bytes] | None = None) -> Cosmos2Conditioning:
    """What every Cosmos family's `encode_prompts` returns: the pipeline's own prompt states (its
    `encode_prompt`) and, with `images` (one per prompt), each prompt's first latent frame
    (`family.first_frame`). Without images: text alone, as the negative prompt is encoded."""
    from .source_images import require_sources

    embeds, _ = family.pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False, device=family.device,
                                          max_sequence_length=family.max_sequence_length)
    if images is None:
        return Cosmos2Conditioning(embeds)
    require_sources(family, prompts, images)
    return Cosmos2Conditioning(embeds, torch.cat([family.first_frame(im) for im in images]))


def latent_stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the Wan VAE's latents per channel, [1, C, 1, 1, 1] on `like`'s device and dtype."""
    cfg = vae.config
    shape = (1, cfg.z_dim, 1, 1, 1)
    return (torch.tensor(cfg.latents_mean).view(shape).to(like.device, like.dtype),
            torch.tensor(cfg.latents_std).view(shape).to(like.device, like.dtype))


def first_latent_frame(family, image: bytes, sigma_data: float = 1.0) -> torch.Tensor:
    """[1, C, 1, H', W']: a source image at the clip's size, encoded as a one-frame clip (the
    posterior's mode), normalised as the Cosmos pipelines' `prepare_latents` — (z − mean)/std·σ_data."""
    from .source_images import source_pixels

    _, pixels = source_pixels(family, image, family.vae.dtype)
    z = family.vae.encode(pixels.unsqueeze(2)).latent_dist.mode().float()
    mean, std = latent_stats(family.vae, z)
    return (z - mean) / std * sigma_data


def decode_clips(vae, latents: torch.Tensor, sigma_data: float = 1.0) -> np.ndarray:
    """Cosmos latents [B, C, F', H', W'] → uint8 clips [B, F, H, W, 3]: ·std/σ_data + mean, decode."""
    z = latents.to(vae.dtype)
    mean, std = latent_stats(vae, z)
    return video_to_uint8(vae.decode(z * std / sigma_data + mean, return_dict=False)[0])


class _GuardrailNotRun:
    """Handed to the pipeline's constructor as its safety checker (which would otherwise build
    Cosmos Guardrail, a separate package), then removed: pixrl never calls the pipeline."""


@functools.cache
def without_guardrail(pipeline_class: str) -> type:
    """A Cosmos pipeline class of diffusers, constructed without building Cosmos Guardrail when
    given no safety checker (the checkpoint may list one — `unread_components` — or none). The
    same name, so a saved model_index.json names diffusers' class."""
    import diffusers

    base = getattr(diffusers, pipeline_class)

    def __init__(self, text_encoder, tokenizer, transformer, vae, scheduler, safety_checker=None):
        base.__init__(self, text_encoder, tokenizer, transformer, vae, scheduler,
                      safety_checker=_GuardrailNotRun() if safety_checker is None else safety_checker)
        if safety_checker is None:
            self.safety_checker = None

    return type(pipeline_class, (base,), {"__init__": __init__, "__module__": __name__})


def padding_mask_resize() -> None:
    """diffusers' Cosmos transformer resizes its padding mask with torchvision's nearest
    `transforms.functional.resize`, imported only when torchvision is installed. Without it the
    module gets the same resize from torch (`interpolate(mode="nearest")`, what torchvision's
    NEAREST is on tensors)."""
    from types import SimpleNamespace

    from diffusers.models.transformers import transformer_cosmos

    if hasattr(transformer_cosmos, "transforms"):
        return

    def resize(mask: torch.Tensor, size: list[int], interpolation=None) -> torch.Tensor:
        return torch.nn.functional.interpolate(mask, size=list(size), mode="nearest")

    transformer_cosmos.transforms = SimpleNamespace(
        functional=SimpleNamespace(resize=resize), InterpolationMode=SimpleNamespace(NEAREST="nearest"))


@register_family("cosmos2")
class Cosmos2Family(PipelineFamily):
    name = "cosmos2"
    pipeline_class = "Cosmos2TextToImagePipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    guidance = "cfg"
    text_tokens = (1, 512)  # the pipeline's 512 T5 tokens by default
    # attention and MLP of every block: cosmos-predict2's LoRA post-training targets (q_proj, k_proj,
    # v_proj, output_proj, mlp.layer1, mlp.layer2) under their diffusers names
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
    unread_components = ("safety_checker",)

    def __init__(self, pipe, *args, **kwargs):
        padding_mask_resize()
        super().__init__(pipe, *args, **kwargs)
        c = self.scheduler.config
        if not c.get("use_karras_sigmas") or c.get("sigma_max") is None:
            raise ModelLoadError(f"{self.path!r}: the Cosmos-Predict2 scheduler steps a Karras grid between "
                                 f"sigma_min and sigma_max (use_karras_sigmas: true in scheduler_config.json, as "
                                 f"the checkpoints ship it); this one does not")

    @classmethod
    def pipeline_type(cls) -> type:
        return without_guardrail(cls.pipeline_class)

    @classmethod
    def check_options(cls, path: Path, options: dict, sampling) -> None:
        """Preflight: the grid's last step is the pipeline's zero-length step at σ_min — no
        transition to store, and CPS would add noise where the pipeline moves nothing."""
        from ..algorithms.recipe import trained_step_count, window_bounds

        last = sampling.steps - 1
        reaches = window_bounds(sampling)[1] > last if sampling.window_size else None
        stored = reaches if reaches is not None else trained_step_count(sampling) > last
        stochastic = reaches if reaches is not None else sampling.noise_level > 0
        if stored or (sampling.sde_type == "cps" and stochastic):
            what = "stores" if stored else "adds CPS noise at"
            raise ModelLoadError(f"the sampling config {what} step {last}, the zero-length last step of the "
                                 f"Cosmos-Predict2 grid (σ_min to σ_min, no distribution); keep it out: "
                                 f"sampling.timestep_fraction < 1 (e.g. {last / sampling.steps:.2f}) or a "
                                 f"window_range ending before {last}")

    @staticmethod
    def default_resolution(pipe) -> tuple[int, int]:
        return 768, 1360  # the pipeline's default image

    @staticmethod
    def resolution_multiple(pipe) -> int:
        return pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size[1]

    def describe(self) -> dict:
        c = self.scheduler.config
        return {"resolution": [self.height, self.width], "guidance": self.guidance, "sigma_max": c.sigma_max,
                "sigma_min": c.sigma_min, "final_sigmas_type": c.get("final_sigmas_type")}

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Cosmos2Conditioning:
        return prompt_conditioning(self, prompts)

    # --- the EDM grid as a flow -----------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int, int]:
        h, w = self.latent_grid(self.pipe.vae_scale_factor_spatial)
        return self.vae.config.z_dim, 1, h, w

    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(flow σ [T+1], transformer times [T]): the pipeline's Karras σ_EDM (its last point
        repeated), each as t = σ/(σ + 1) — the time the transformer reads, in float32 as the
        pipeline computes it."""
        from copy import deepcopy

        sched = deepcopy(self.scheduler)
        sched.set_timesteps(sigmas=torch.linspace(0, 1, steps, dtype=torch.float64).numpy(), device=self.device)
        edm = sched.sigmas.float().clone()
        if sched.config.get("final_sigmas_type", "zero") == "sigma_min":
            edm[-1] = edm[-2]
        t = edm / (edm + 1)
        return t, t[:-1].clone()

    def timesteps_at(self, sigma: torch.Tensor) -> torch.Tensor:
        """The transformer's time at flow noise levels σ: σ itself (t = σ_EDM/(σ_EDM + 1))."""
        return sigma.float()

    def latent_scales(self, first_sigma: float, last_sigma: float) -> tuple[float, float]:
        """(the flow latent's factor of ε at the grid's start, the divisor that turns the last flow
        latent into the pipeline's x = x_flow/(1 − t)): the pipeline starts from σ_max·ε, whose
        flow latent (1 − t0)·σ_max·ε is t0·ε."""
        return first_sigma, 1.0 - last_sigma

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: Cosmos2Conditioning,
                 guidance_scale: float = 1.0, neg: Cosmos2Conditioning | None = None) -> torch.Tensor:
        """The transformer's output at the flow latent (the flow velocity); s > 1: the pipeline's
        CFG with w = s − 1, a conditional pass then an unconditional one."""
        b = x.shape[0]
        t = timestep.reshape(-1).to(x.device)
        t = t.expand(b) if t.numel() == 1 else t
        v = self._predict(x, t, cond)
        if guidance_scale > 1.0:
            if neg is None:
                raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
            v_u = self._predict(x, t, neg)
            v = v + (guidance_scale - 1.0) * (v - v_u)
        return v

    def _predict(self, x: torch.Tensor, t: torch.Tensor, cond: Cosmos2Conditioning) -> torch.Tensor:
        dtype = self.transformer.dtype
        pad = x.new_zeros(1, 1, self.height, self.width, dtype=dtype)
        return self.transformer(hidden_states=x.to(dtype), timestep=t.to(dtype),
                                encoder_hidden_states=cond.prompt_embeds.to(dtype), padding_mask=pad,
                                return_dict=False)[0].float()

    # --- pixels -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [B, C, 1, H', W'] (the pipeline's, at σ_min) → uint8 [B, H, W, 3]: the
        latent std and mean undone (and σ_data), decode, the clip's one frame."""
        return decode_clips(self.vae, latents, self.scheduler.config.sigma_data)[:, 0]

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random Cosmos-Predict2-T2I-shaped checkpoint: a one-block CosmosTransformer3DModel with
        the 2B's settings (padding-mask channel, RoPE scale (1, 4, 4), no learnable position
        embedding), a tiny T5 encoder and tokenizer, the tiny Wan VAE (latent mean/std), and the
        checkpoint's scheduler (Karras, σ 80 → 0.002, final σ_min); saved without a safety
        checker. Returns the overrides that run it (32 px)."""
        import shutil

        from diffusers import CosmosTransformer3DModel

        from .tiny_parts import t5_encoder
        from .wan import tiny_wan_parts

        build = out_dir.parent / (out_dir.name + "_build")
        parts = tiny_wan_parts(build, seed)
        parts["text_encoder"] = t5_encoder(parts["tokenizer"])
        z = parts["vae"].config.z_dim
        transformer = CosmosTransformer3DModel(
            in_channels=z, out_channels=z, num_attention_heads=2, attention_head_dim=16, num_layers=1, mlp_ratio=2.0,
            text_embed_dim=32, adaln_lora_dim=8, max_size=(4, 32, 32), patch_size=(1, 2, 2), rope_scale=(1.0, 4.0, 4.0),
            concat_padding_mask=True, extra_pos_embed_type=None)
        pipe = cosmos2_pipeline(**{**parts, "scheduler": cosmos2_scheduler()}, transformer=transformer)
        pipe.save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32,
                "model.max_sequence_length": 64}


def cosmos2_scheduler():
    """The Cosmos-Predict2 checkpoints' scheduler: flow-match Euler on a Karras grid (shift 1)
    between σ_max = 80 and σ_min = 0.002, the last σ repeated (the pipeline registers these)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True, shift=1.0)
    sched.register_to_config(sigma_max=80.0, sigma_min=0.002, sigma_data=1.0, final_sigmas_type="sigma_min")
    return sched


def cosmos2_pipeline(pipeline_class: str = "Cosmos2TextToImagePipeline", **components):
    """A Cosmos-Predict2 pipeline of `components` without a safety checker (what `write_tiny`
    and the real-shape smoke save)."""
    return without_guardrail(pipeline_class)(**components)
