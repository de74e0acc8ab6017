"""LTX-2 text-to-audio+video (LTX-2.0 and 2.3): diffusers LTX2VideoTransformer3DModel, one DiT
that denoises a clip's video tokens and its soundtrack's audio tokens together (each stream
attends to the other), AutoencoderKLLTX2Video (×8 in time, ×32 in space), an audio VAE over mel
spectrograms with a vocoder, and a Gemma-3 text encoder whose every layer's states the text
connectors turn into one prompt sequence per stream.

The policy's action is the joint sample: pixrl's latent is the clip's packed video tokens
followed by its packed audio tokens, [N_video + N_audio, D] (LTX-2's both 128 features wide), so
one flow-matching step — and one Gaussian log-prob — covers both, on the schedule LTX2Pipeline
shares between them (`linspace(1, 1/T, T)` under the dynamic shift of the video tokens).

Guidance is the pipeline's, in x₀-space (x₀ = x − σ·v), per stream with its own scales:
classifier-free (`sampling.guidance_scale` for video, `model.av_guidance.audio_guidance_scale` for audio,
both applied whenever the sampler batches the negative prompt), spatio-temporal guidance (a pass
with self-attention perturbed in `stg_blocks`; skipped for a DiT without perturbable
attention, LTX-2.0's, where the pipeline's pass equals the conditional one), modality-isolation
guidance (a pass with the audio↔video cross-attention off) and the guidance rescale, then back
to a velocity. The pipeline's defaults are the family's (`model.av_guidance` sets the others).

Decode: the video stream as LTX-Video's (per clip, `decode_timestep`/`decode_noise_scale` for a
timestep-conditioned VAE); the soundtrack with `decode_audio` (waveforms at the vocoder's rate).
The clip's frame rate sets the soundtrack's length and, divided by `model.motion_speed` (the
pipeline's conditioning frame rate: below 1 conditions on a higher rate, so motion plays slower —
0.2 for the Slow-Motion-Control LoRA), the rotary time axis (`model.frame_rate`, the pipeline's 24).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from .base import ModelLoadError
from .ltx_video import LTXVideoFamily
from .pipelines import SIGMAS_OPTION, encodes_text
from .registry import register_family

__all__ = ["LTX2Conditioning", "LTX2Family", "StreamGuidance"]


@dataclass
class LTX2Conditioning:
    """The connectors' prompt sequences for the video and the audio stream, and their mask."""

    video: torch.Tensor  # [B, L, Dv]
    audio: torch.Tensor  # [B, L, Da]
    mask: torch.Tensor  # [B, L] binary

    def select(self, idx) -> "LTX2Conditioning":
        return LTX2Conditioning(self.video[idx], self.audio[idx], self.mask[idx])

    def expand(self, n: int) -> "LTX2Conditioning":
        return LTX2Conditioning(self.video.expand(n, -1, -1), self.audio.expand(n, -1, -1), self.mask.expand(n, -1))


@dataclass(frozen=True)
class StreamGuidance:
    """One stream's guidance scales, as LTX2Pipeline names them."""

    cfg: float
    stg: float
    modality: float
    rescale: float

    def combine(self, c, u, stg, mod):
        """x₀ predictions (conditional, negative, perturbed, isolated; None where that pass did
        not run) → the guided x₀, term by term in the pipeline's order, then rescaled."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

        cfg_delta = (self.cfg - 1) * (c - u) if u is not None else 0
        stg_delta = self.stg * (c - stg) if stg is not None else 0
        mod_delta = (self.modality - 1) * (c - mod) if mod is not None else 0
        guided = c + cfg_delta + stg_delta + mod_delta
        return rescale_noise_cfg(guided, c, guidance_rescale=self.rescale) if self.rescale > 0 else guided


@register_family("ltx2")
class LTX2Family(LTXVideoFamily):
    name = "ltx2"
    pipeline_class = "LTX2Pipeline"
    text_tokens = (1, 1024)  # Gemma tokens (the pipeline's 1024)
    default_frames = 121  # the pipeline's fixed default
    conditioning_towers = ("text_encoder", "connectors")
    unread_components = ("processor", "prompt_enhancer", "duration_head")
    audio = True  # the latent carries a soundtrack (`decode_audio`)

    options = {**LTXVideoFamily.options, **SIGMAS_OPTION,
               "frame_rate": "frames per second of the clip: its soundtrack's length and the rotary time axis "
                             "(the pipeline's 24)",
               "motion_speed": "speed of the motion relative to real time: the rotary time axis reads frame_rate / "
                               "motion_speed (the pipeline's 1)",
               "audio_guidance_scale": "CFG scale of the audio stream when CFG runs (the pipeline's 7)",
               "guidance_rescale": "x0 guidance rescale of the video stream (the pipeline's 0.7)",
               "audio_guidance_rescale": "x0 guidance rescale of the audio stream (the pipeline's 0.7)",
               "stg_scale": "spatio-temporal guidance scale of the video stream (the pipeline's 1; 0: off)",
               "audio_stg_scale": "spatio-temporal guidance scale of the audio stream (the pipeline's 1)",
               "stg_blocks": "the DiT blocks whose self-attention spatio-temporal guidance perturbs "
                             "(the pipeline's [28])",
               "modality_scale": "modality-isolation guidance scale of the video stream (the pipeline's 3; 1: off)",
               "audio_modality_scale": "modality-isolation guidance scale of the audio stream (the pipeline's 3)"}

    def __init__(self, pipe, *args, frame_rate: float = 24.0, motion_speed: float = 1.0,
                 audio_guidance_scale: float = 7.0, guidance_rescale: float = 0.7, audio_guidance_rescale: float = 0.7,
                 stg_scale: float = 1.0, audio_stg_scale: float = 1.0, stg_blocks=(28,), modality_scale: float = 3.0,
                 audio_modality_scale: float = 3.0, **kwargs):
        super().__init__(pipe, *args, frame_rate=frame_rate, **kwargs)
        if motion_speed <= 0:
            raise ModelLoadError(f"model.motion_speed={motion_speed}: must be positive (1: real time; 0.2: 5× slow motion)")
        self.motion_speed = float(motion_speed)
        self.rope_fps = self.frame_rate / self.motion_speed  # the pipeline's conditioning frame rate
        # the pipeline's rule: an unset (or zero) audio setting takes the video one
        self.video_guidance = StreamGuidance(1.0, float(stg_scale), float(modality_scale), float(guidance_rescale))
        self.audio_guidance = StreamGuidance(float(audio_guidance_scale), float(audio_stg_scale or stg_scale),
                                             float(audio_modality_scale or modality_scale),
                                             float(audio_guidance_rescale or guidance_rescale))
        self.stg_blocks = [int(b) for b in (stg_blocks or ())]
        if self.video_guidance.stg > 0 or self.audio_guidance.stg > 0:  # (blocks are not read otherwise)
            depth = len(self.transformer.transformer_blocks)
            if not self.stg_blocks:
                raise ModelLoadError("model.av_guidance.stg_scale > 0 needs stg_blocks (the blocks whose "
                                     "self-attention it perturbs), or set model.av_guidance.stg_scale=0 and "
                                     "audio_stg_scale=0")
            if any(not 0 <= b < depth for b in self.stg_blocks):
                raise ModelLoadError(f"model.av_guidance.stg_blocks={self.stg_blocks}: this DiT has blocks "
                                     f"0–{depth - 1}")
        # the clip's token layout, fixed once loaded: read on every DiT pass
        self.audio_shape = self._audio_shape()  # (latent length, channels, latent mel bins); refuses unequal widths
        f, h, w = self._video_grid()
        p, pt = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        self.video_tokens = (f // pt) * (h // p) * (w // p)

    @staticmethod
    def default_resolution(pipe) -> tuple[int, int]:
        return 512, 768  # the pipeline's default clip

    def describe(self) -> dict:
        return {**super().describe(), "audio_tokens": self.audio_shape[0], "motion_speed": self.motion_speed,
                "stg_blocks": self.stg_blocks,
                "stg_active": self._stg_active(),  # the video stream's CFG scale is sampling.guidance_scale
                "video_guidance": {k: v for k, v in vars(self.video_guidance).items() if k != "cfg"},
                "audio_guidance": vars(self.audio_guidance)}

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> LTX2Conditioning:
        return self.encode_text(prompts)

    def encode_text(self, prompts: list[str]) -> LTX2Conditioning:
        """The pipeline's `encode_prompt` (every Gemma layer's states, left-padded to max length),
        then its connectors; towers resident."""
        embeds, mask, _, _ = self.pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False,
                                                     max_sequence_length=self.max_sequence_length, device=self.device)
        side = getattr(self.pipe.tokenizer, "padding_side", "left")
        video, audio, mask = self.pipe.connectors(embeds, mask, padding_side=side)
        return LTX2Conditioning(video, audio, mask)

    # --- the joint latent ---------------------------------------------------------------------
    def _video_grid(self) -> tuple[int, int, int]:
        """(frames, height, width) of the clip's video latents, before the DiT's patching."""
        h, w = self.latent_grid(self.pipe.vae_spatial_compression_ratio)
        return (self.frames - 1) // self.pipe.vae_temporal_compression_ratio + 1, h, w

    def _audio_shape(self) -> tuple[int, int, int]:
        """(latent length, channels, latent mel bins) of the soundtrack, as the pipeline sizes it
        from the clip's duration."""
        pipe = self.pipe
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        length = round(self.frames / self.frame_rate * per_second)
        cfg = pipe.audio_vae.config
        mel = cfg.mel_bins // pipe.audio_vae_mel_compression_ratio
        p, pt = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        video_features = self.transformer.config.in_channels * p * p * pt
        if cfg.latent_channels * mel != video_features:
            raise ModelLoadError(f"{self.path!r}: its video tokens have {video_features} features and its audio "
                                 f"tokens {cfg.latent_channels * mel}; the ltx2 family stacks both streams in one "
                                 "latent and needs them equal (LTX-2's are both 128)")
        return length, cfg.latent_channels, mel

    def latent_shape(self) -> tuple[int, int]:
        p, pt = self.pipe.transformer_spatial_patch_size, self.pipe.transformer_temporal_patch_size
        return self.video_tokens + self.audio_shape[0], self.transformer.config.in_channels * p * p * pt

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Joint latents [B, N_video + N_audio, D] → (video tokens, audio tokens)."""
        return x[:, :self.video_tokens], x[:, self.video_tokens:]

    def _mu(self) -> float:
        """The dynamic shift's μ of the clip's video tokens, with LTX2Pipeline's defaults."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

        c = self.scheduler.config
        return calculate_shift(self.video_tokens, c.get("base_image_seq_len", 1024), c.get("max_image_seq_len", 4096),
                               c.get("base_shift", 0.95), c.get("max_shift", 2.05))

    # --- dynamics -----------------------------------------------------------------------------
    def _stg_active(self) -> bool:
        """Whether the perturbed pass changes anything: a scale > 0 and a DiT with perturbable
        self-attention (LTX-2.3's; LTX-2.0's pass would equal the conditional one)."""
        scaled = self.video_guidance.stg > 0 or self.audio_guidance.stg > 0
        return scaled and bool(self.transformer.config.get("perturbed_attn", False))

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: LTX2Conditioning,
                 guidance_scale: float = 1.0, neg: LTX2Conditioning | None = None) -> torch.Tensor:
        """v_θ(x, t | c) of the joint latents; the pipeline's guidance in x₀-space (module docstring):
        CFG when guidance_scale > 1 (its negative conditioning given), STG and modality isolation
        when their scales are on, each stream rescaled, then back to a velocity."""
        t = self.row_timesteps(x, timestep, guidance_scale, neg)
        return torch.cat(self.guided(*self.split(x), t, cond, guidance_scale, neg), dim=1)

    def row_timesteps(self, x: torch.Tensor, timestep: torch.Tensor, guidance_scale: float, neg) -> torch.Tensor:
        """Each row's timestep [B], after the check every velocity makes (a negative for CFG)."""
        b = x.shape[0]
        t = timestep.reshape(-1).to(x.device)
        if guidance_scale > 1.0 and neg is None:
            raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
        return t.expand(b) if t.numel() == 1 else t

    def guided(self, xv: torch.Tensor, xa: torch.Tensor, t: torch.Tensor, cond: LTX2Conditioning,
               guidance_scale: float, neg: LTX2Conditioning | None,
               video_t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(video, audio) velocities of the streams' tokens with every guidance term, from x₀ =
        x − σ·v at the rows' σ; `video_t`: per-token timesteps of the video stream (a held first
        frame's at 0; the audio stream's are then `t`)."""
        b = xv.shape[0]
        sigma = (t.float() / self.scheduler.config.num_train_timesteps).view(b, 1, 1)
        f, h, w = self._video_grid()  # the positions every pass of this step reads
        coords = (self.transformer.rope.prepare_video_coords(b, f, h, w, xv.device, fps=self.rope_fps),
                  self.transformer.audio_rope.prepare_audio_coords(b, xa.shape[1], xv.device))

        def x0(c_, **kw):  # one DiT pass, then the pipeline's `convert_velocity_to_x0` per stream
            v, a = self._predict(xv, xa, t, c_, coords, video_t=video_t, **kw)
            return xv - v * sigma, xa - a * sigma

        c = x0(cond)
        u = x0(neg) if guidance_scale > 1.0 else (None, None)
        stg = x0(cond, stg_blocks=self.stg_blocks) if self._stg_active() else (None, None)
        modality = self.video_guidance.modality > 1 or self.audio_guidance.modality > 1
        mod = x0(cond, isolate=True) if modality else (None, None)
        video = replace(self.video_guidance, cfg=float(guidance_scale) if guidance_scale > 1.0 else 1.0)
        gv = video.combine(c[0], u[0], stg[0], mod[0])
        ga = self.audio_guidance.combine(c[1], u[1], stg[1], mod[1])
        return (xv - gv) / sigma, (xa - ga) / sigma

    def _predict(self, xv: torch.Tensor, xa: torch.Tensor, t: torch.Tensor, cond: LTX2Conditioning, coords,
                 stg_blocks=None, isolate: bool = False,
                 video_t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One DiT pass on both streams' tokens (at their positions `coords`) → (video, audio)
        velocities in float32."""
        dtype = self.transformer.dtype
        f, h, w = self._video_grid()
        v, a = self.transformer(
            hidden_states=xv.to(dtype), audio_hidden_states=xa.to(dtype),
            encoder_hidden_states=cond.video.to(dtype), audio_encoder_hidden_states=cond.audio.to(dtype),
            timestep=t if video_t is None else video_t, audio_timestep=None if video_t is None else t, sigma=t,
            encoder_attention_mask=cond.mask, audio_encoder_attention_mask=cond.mask,
            num_frames=f, height=h, width=w, fps=self.rope_fps, audio_num_frames=xa.shape[1],
            video_coords=coords[0], audio_coords=coords[1], isolate_modalities=isolate,
            spatio_temporal_guidance_blocks=stg_blocks, perturbation_mask=None, use_cross_timestep=True,
            return_dict=False)
        return v.float(), a.float()

    # --- pixels and sound -----------------------------------------------------------------------
    def video_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Joint latents → the video stream unpacked to [B, C, F', H', W'] (normalised)."""
        f, h, w = self._video_grid()
        p, pt = self.pipe.transformer_spatial_patch_size, self.pipe.transformer_temporal_patch_size
        return self.pipe._unpack_latents(self.split(latents)[0], f // pt, h // p, w // p, p, pt)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Joint latents → uint8 clips [B, F, H, W, 3] (the video stream, as LTX-Video decodes)."""
        return super().decode(self.video_latents(latents))

    @torch.no_grad()
    def decode_audio(self, latents: torch.Tensor) -> tuple[np.ndarray, int]:
        """Joint latents → (float32 waveforms [B, channels, samples], sample rate): the audio
        stream un-normalised, unpacked to a latent spectrogram, the audio VAE's mel spectrogram,
        the vocoder — as the pipeline renders its `audio`."""
        pipe, avae = self.pipe, self.pipe.audio_vae
        length, _, mel = self.audio_shape
        za = pipe._denormalize_audio_latents(self.split(latents)[1].float(), avae.latents_mean, avae.latents_std)
        za = pipe._unpack_audio_latents(za, length, num_mel_bins=mel)
        wave = pipe.vocoder(avae.decode(za.to(avae.dtype), return_dict=False)[0])
        rate = pipe.vocoder.config.get("output_sampling_rate", pipe.audio_sampling_rate)
        return wave.float().cpu().numpy(), int(rate)

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0, variant: str = "2.3") -> dict:
        """A random LTX-2-shaped pipeline (models/tiny_ltx2.py; LTX-2.3's layout by default) with
        tiny widths. Returns the overrides that run it (64 px, 9 frames at 24 fps: 3 × 4 × 4 video
        and 9 audio latents)."""
        import shutil

        from diffusers import LTX2Pipeline

        from .tiny_ltx2 import tiny_parts

        build = out_dir.parent / (out_dir.name + "_build")
        LTX2Pipeline(**tiny_parts(build, seed, variant)).save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 64, "model.frames": 9,
                "model.max_sequence_length": 32, "model.av_guidance.stg_blocks": [1]}
