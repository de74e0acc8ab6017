"""Wan2.1 / Wan2.2 text-to-video family: diffusers WanTransformer3DModel (3-D patches 1×2×2,
video latents [C, F, H, W]) + AutoencoderKLWan (causal video VAE: ×4 in time, ×8 or ×16 in
space, per-channel latent mean/std) + a UMT5 text encoder + the checkpoint's flow scheduler
(UniPCMultistep with flow sigmas and `flow_shift`, as the Wan checkpoints ship it).

Loads any directory in the diffusers WanPipeline layout and reuses the pipeline's own
`encode_prompt` (prompt cleaning, UMT5, zero past each prompt's length). Clips have
`model.frames` frames (4k+1; the pipeline's 81 by default); latents are the pipeline's
[C, (F−1)/4 + 1, H/8, W/8]. Wan2.2-TI2V-5B (`expand_timesteps`: a timestep per latent token)
runs the same way.

Two experts (Wan2.2-T2V-A14B: `transformer` denoises t ≥ boundary_ratio·T, `transformer_2` the
rest, with its own CFG scale `guidance_scale_2`): sampling uses both, as the pipeline does;
`model.expert` names the one trained (high or low), the other samples frozen — the practice of
the trainers that fine-tune A14B (one expert per run, each on its own timesteps). Its LoRA, its
full weights, its FSDP shards and its checkpoints are that expert's; set the SDE window on its
steps (steps of the frozen expert replay at ratio 1 and give no gradient; preflight checks the
window). Algorithms train only the trained expert's steps (`trains_timesteps`): Flow-GRPO and its
kin replay and count only its stored transitions, DanceGRPO and DiffusionNFT draw their steps
among its grid steps, and Diffusion-DPO draws its σ on its side (`trained_sigmas`).

Sampling: rollouts step the σ grid of the checkpoint's scheduler with the shared Euler/SDE
kernels (flow_grpo samples Wan with its SDE; a multistep solver step carries no log-prob).
Guidance is the pipeline's CFG: a conditional and an unconditional pass, combined.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .base import ModelLoadError
from .pipelines import PipelineFamily, encodes_text, scheduler_grid
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime

__all__ = ["WanConditioning", "WanFamily", "video_to_uint8"]


@dataclass
class WanConditioning:
    """UMT5 hidden states of the prompts, zeroed past each prompt's length (no mask, as the pipeline)."""

    prompt_embeds: torch.Tensor  # [B, L, D]

    def select(self, idx) -> "WanConditioning":
        return WanConditioning(self.prompt_embeds[idx])

    def expand(self, n: int) -> "WanConditioning":
        return WanConditioning(self.prompt_embeds.expand(n, -1, -1))


@register_family("wan")
class WanFamily(PipelineFamily):
    name = "wan"
    pipeline_class = "WanPipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    guidance = "cfg"
    video = True
    text_tokens = (1, 512)  # the pipeline's 226 by default (UMT5)
    # the attention projections of self- and cross-attention in every block (the suffixes of
    # flow_grpo's LoRA target list that exist in a Wan text-to-video transformer)
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]
    default_frames = 81  # the pipeline's num_frames
    decode_batch = 2  # clips per VAE decode: 81 frames of 480² each hold gigabytes of activations

    options = {"expert": "the trained expert of a two-expert checkpoint: high or low",
               "guidance_scale_2": "the low-noise expert's CFG scale"}

    def __init__(self, pipe, *args, expert: str | None = None, guidance_scale_2: float | None = None, **kwargs):
        super().__init__(pipe, *args, **kwargs)
        self._check_experts(self.path, _has_two_experts(pipe), expert, guidance_scale_2)
        self.expert, self.guidance_scale_2 = expert, guidance_scale_2
        self.frozen_expert: torch.nn.Module | None = None
        self.boundary: float | None = None  # in the transformer's timestep units (σ·T)
        if expert is not None:
            self.boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
            high, low = pipe.transformer, pipe.transformer_2
            self.transformer, self.frozen_expert = (high, low) if expert == "high" else (low, high)
            self.frozen_expert.requires_grad_(False)
        self.set_clip_frames()

    @classmethod
    def trained_component(cls, options: dict) -> str:
        return "transformer_2" if options.get("expert") == "low" else "transformer"

    @staticmethod
    def _check_experts(path: str, two: bool, expert: str | None, guidance_scale_2: float | None) -> None:
        if two and expert is None:
            raise ModelLoadError(f"{path!r} is a two-expert Wan2.2 checkpoint (transformer for the high-noise steps, "
                                 "transformer_2 for the low-noise ones): choose the one to train with "
                                 "model.expert=high or model.expert=low")
        if not two and (expert is not None or guidance_scale_2 is not None):
            which = "model.expert" if expert is not None else "model.guidance_scale_2"
            raise ModelLoadError(f"{which}: {path!r} has one transformer (Wan2.1, Wan2.2-TI2V-5B); it applies to "
                                 "two-expert checkpoints (Wan2.2-A14B) only — unset it")

    @classmethod
    def check_options(cls, path: Path, options: dict, sampling) -> None:
        """Preflight: model.expert / model.guidance_scale_2 against the checkpoint's model_index.json,
        and the steps the sampling config trains against the trained expert's steps."""
        import json

        index = json.loads((Path(path) / "model_index.json").read_text())
        two = isinstance(index.get("transformer_2"), list) and index["transformer_2"][0] is not None
        cls._check_experts(str(path), two, options.get("expert"), options.get("guidance_scale_2"))
        if options.get("guidance_scale_2") is not None and sampling.guidance_scale <= 1.0:
            raise ModelLoadError(f"model.guidance_scale_2={options['guidance_scale_2']}: CFG is off "
                                 f"(sampling.guidance_scale={sampling.guidance_scale}), as in the pipeline, which "
                                 "then ignores it — set sampling.guidance_scale > 1 or unset model.guidance_scale_2")
        if two:
            cls._check_expert_steps(Path(path), index["scheduler"][1], index["boundary_ratio"], options["expert"],
                                    sampling)

    @classmethod
    def _check_expert_steps(cls, path: Path, scheduler_class: str, boundary_ratio: float, expert: str,
                            sampling) -> None:
        """An SDE window must lie on the trained expert's steps (the other's give no gradient: a
        window wholly there would leave an update with nothing to train); every-step SDE must
        reach at least one of them. The steps are those of the grid rollouts step."""
        import diffusers

        from ..algorithms.recipe import trained_step_count, window_bounds

        sched = getattr(diffusers, scheduler_class).from_pretrained(str(path), subfolder="scheduler")
        _, timesteps = scheduler_grid(sched, sampling.steps, "cpu", cls.name, str(path))
        high = [float(t) >= boundary_ratio * sched.config.num_train_timesteps for t in timesteps]
        ours = [k for k, h in enumerate(high) if h == (expert == "high")]
        if sampling.window_size:
            lo, hi = window_bounds(sampling)
            outside = [k for k in range(lo, hi) if k not in ours]
            if outside:
                raise ModelLoadError(
                    f"sampling.window_range=[{lo},{hi}] reaches step(s) {outside} of {sampling.steps}, which the frozen "
                    f"{'low' if expert == 'high' else 'high'}-noise expert denoises; model.expert={expert} denoises "
                    f"steps {ours}: set the window range within them")
        elif not any(k in ours for k in range(trained_step_count(sampling))):
            raise ModelLoadError(f"no trained step of {sampling.steps} is model.expert={expert}'s (its steps: {ours}); "
                                 "raise sampling.timestep_fraction or train the other expert")

    def trained_sigmas(self) -> tuple[float, float] | None:
        """The σ range the trained weights denoise (a two-expert checkpoint: its expert's side of the
        boundary); None: every σ. Algorithms that draw σ themselves (Diffusion-DPO) draw within it."""
        if self.expert is None:
            return None
        b = self.boundary / self.scheduler.config.num_train_timesteps
        return (b, 1.0) if self.expert == "high" else (0.0, b)

    def trains_timesteps(self, timesteps: torch.Tensor) -> torch.Tensor | None:
        """Per grid timestep, whether the trained weights compute its velocity (the comparison
        `velocity` dispatches on); None: one transformer, every step is trained."""
        if self.expert is None:
            return None
        high = timesteps.reshape(-1) >= self.boundary
        return high if self.expert == "high" else ~high

    @staticmethod
    def default_resolution(pipe) -> tuple[int, int]:
        return 480, 832  # the pipeline's default clip

    @staticmethod
    def resolution_multiple(pipe) -> int:
        return pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size[1]

    def describe(self) -> dict:
        c = self.scheduler.config
        out = {"resolution": [self.height, self.width], "frames": self.frames,
               "shift": c.get("flow_shift", c.get("shift")), "scheduler": type(self.scheduler).__name__,
               "guidance": self.guidance}
        if self.expert is not None:
            out.update(expert=self.expert, boundary=self.boundary, guidance_scale_2=self.guidance_scale_2)
        return out

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> WanConditioning:
        return self.encode_text(prompts)

    def encode_text(self, prompts: list[str]) -> WanConditioning:
        """The pipeline's `encode_prompt` (UMT5, zero past each prompt's length); towers resident."""
        embeds, _ = self.pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=self.device,
                                            max_sequence_length=self.max_sequence_length)
        return WanConditioning(embeds)

    # --- dynamics -----------------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int, int]:
        """[C, F', H', W'] of the VAE's latents (the transformer may read more channels: image-to-video
        concatenates its condition to them)."""
        h, w = self.latent_grid(self.pipe.vae_scale_factor_spatial)
        frames = (self.frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        return self.vae.config.z_dim, frames, h, w

    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        return scheduler_grid(self.scheduler, steps, self.device, self.name, self.path)

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: WanConditioning,
                 guidance_scale: float = 1.0, neg: WanConditioning | None = None) -> torch.Tensor:
        """v_θ(x, t | c) on video latents [B, C, F, H, W]; guidance_scale > 1: the pipeline's CFG
        (conditional pass, then unconditional)."""
        b, _, f, h, w = x.shape
        t = timestep.reshape(-1).to(x.device)
        t = t.expand(b) if t.numel() == 1 else t
        if self.pipe.config.expand_timesteps:  # Wan2.2-TI2V: one timestep per latent token
            _, ph, pw = self.transformer.config.patch_size
            t = t[:, None].expand(b, f * (h // ph) * (w // pw))
        if guidance_scale > 1.0 and neg is None:
            raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
        if self.expert is None:
            return self._guided(self.transformer, x, t, cond, neg, guidance_scale)
        high = timestep.reshape(-1).to(x.device).expand(b) >= self.boundary  # the pipeline's `t >= boundary`
        if bool(high.all()) or not bool(high.any()):  # a sampler step: every row on one side
            return self._expert(bool(high[0]), x, t, cond, neg, guidance_scale)
        v_high = self._expert(True, x[high], t[high], cond.select(high), _rows(neg, high), guidance_scale)
        v_low = self._expert(False, x[~high], t[~high], cond.select(~high), _rows(neg, ~high), guidance_scale)
        v = v_high.new_empty(x.shape)
        v[high], v[~high] = v_high, v_low
        return v

    def _expert(self, high: bool, x, t, cond: WanConditioning, neg: WanConditioning | None,
                guidance_scale: float) -> torch.Tensor:
        """The high- or low-noise expert's guided velocity, as the pipeline switches them."""
        module = self.transformer if (self.expert == "high") == high else self.frozen_expert
        scale = guidance_scale if high or self.guidance_scale_2 is None else self.guidance_scale_2
        return self._guided(module, x, t, cond, neg, guidance_scale, scale)

    def _guided(self, module, x, t, cond: WanConditioning, neg: WanConditioning | None, guidance_scale: float,
                scale: float | None = None) -> torch.Tensor:
        """One expert's velocity with the pipeline's CFG: on when `guidance_scale` > 1, combined at
        `scale` (the low-noise expert's own, for a two-expert checkpoint)."""
        v = self._predict(module, x, t, cond)
        if guidance_scale > 1.0:
            v_u = self._predict(module, x, t, neg)
            v = v_u + (scale or guidance_scale) * (v - v_u)
        return v

    def _predict(self, module, x, t, cond: WanConditioning) -> torch.Tensor:
        dtype = module.dtype
        return module(hidden_states=x.to(dtype), timestep=t, encoder_hidden_states=cond.prompt_embeds.to(dtype),
                      return_dict=False)[0]

    # --- pixels -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [B, C, F', H', W'] → uint8 clips [B, F, H, W, 3]: the latent mean/std undone, decode."""
        cfg = self.vae.config
        z = latents.to(self.vae.dtype)
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        return video_to_uint8(self.vae.decode(z / inv_std + mean, return_dict=False)[0])

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0, two_experts: bool = False) -> dict:
        """A random Wan2.1-shaped pipeline (UMT5 with a SentencePiece-Unigram tokenizer, causal video
        VAE ×2 in time and ×4 in space with latent mean/std, 3-D-patch DiT, UniPC with flow sigmas
        and flow_shift 3) with tiny widths. Returns the overrides that run it (32 px, 5 frames).
        `two_experts`: Wan2.2-T2V-A14B's layout — a second, differently initialised transformer for
        the low-noise steps and its boundary_ratio 0.875 (the high-noise expert is trained)."""
        import shutil

        from diffusers import WanPipeline

        build = out_dir.parent / (out_dir.name + "_build")
        parts = tiny_wan_parts(build, seed)
        z = parts["vae"].config.z_dim
        transformer = tiny_wan_transformer(z, z)
        experts = {}
        if two_experts:
            torch.manual_seed(seed + 1)
            experts = dict(transformer_2=tiny_wan_transformer(z, z), boundary_ratio=0.875)
        WanPipeline(**parts, transformer=transformer, **experts).save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32, "model.frames": 5,
                "model.max_sequence_length": 64,
                # the high-noise expert trains; the SDE window on its steps (t ≥ 875: the first 2 of 4, 4 of 10)
                **({"model.expert": "high", "sampling.window_size": 2, "sampling.window_range": "[0,2]"}
                   if two_experts else {})}


def tiny_wan_parts(build: Path, seed: int) -> dict:
    """The shared tiny parts of a Wan pipeline (seeded): tokenizer, UMT5, the causal video VAE
    (×2 in time, ×4 in space, 4 latent channels with mean/std) and UniPC with flow sigmas."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    from .tiny_parts import t5_tokenizer

    torch.manual_seed(seed)
    tok = t5_tokenizer(build / "tokenizer", 512)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tok), d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        is_encoder_decoder=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        decoder_start_token_id=0))
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, True], latents_mean=[0.1, -0.2, 0.05, 0.0],
                           latents_std=[1.5, 2.0, 1.2, 1.8], scale_factor_temporal=2, scale_factor_spatial=4)
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                    num_train_timesteps=1000)
    return dict(tokenizer=tok, text_encoder=text_encoder, vae=vae, scheduler=sched)


def tiny_wan_transformer(in_channels: int, out_channels: int, **extra):
    """A 2-block WanTransformer3DModel with 16-wide attention (`extra`: image-to-video's image inputs)."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                 in_channels=in_channels, out_channels=out_channels, text_dim=32, freq_dim=32,
                                 ffn_dim=32, num_layers=2, rope_max_seq_len=32, **extra)


def _rows(cond: WanConditioning | None, rows: torch.Tensor) -> WanConditioning | None:
    return None if cond is None else cond.select(rows)


def _has_two_experts(pipe) -> bool:
    return getattr(pipe, "transformer_2", None) is not None


def video_to_uint8(video: torch.Tensor) -> np.ndarray:
    """VAE output in [-1, 1], [B, 3, F, H, W] → uint8 [B, F, H, W, 3], as the video processor postprocesses."""
    v = (video.float() / 2 + 0.5).clamp(0, 1)
    return (v.permute(0, 2, 3, 4, 1).cpu().numpy() * 255).round().astype(np.uint8)
