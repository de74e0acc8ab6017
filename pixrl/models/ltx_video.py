"""LTX-Video text-to-video (0.9.x): diffusers LTXVideoTransformer3DModel (a DiT over 1×1×1 patches
of 128-channel latents, rotary positions scaled to the clip's frame rate), AutoencoderKLLTXVideo
(×8 in time, ×32 in space, per-channel latent mean/std; from 0.9.1 a decoder conditioned on a
timestep, with noise injected in its blocks), a T5 text encoder with its attention mask, and a
flow-matching Euler schedule (`linspace(1, 1/T, T)` with the dynamic shift of the clip's token
count, stretched to the checkpoint's `shift_terminal`).

Sampling, CFG (`uncond + s·(cond − uncond)`) and the transformer's inputs are LTXPipeline's; the
latents stay [C, F, H, W] and are packed into tokens for each transformer call. Clips have
`model.frames` frames (8k+1; the pipeline's 161 by default) and the rotary time axis reads
`model.frame_rate` (the pipeline's 25).

Decode is the pipeline's: latents un-normalised, and — for a VAE with timestep conditioning —
mixed with `model.decode_noise_scale` of fresh noise and decoded at `model.decode_timestep`
(LTX-Video 0.9.1's recommended 0.03 and 0.025; the pipeline's defaults are 0). Its VAE also
injects noise inside the decoder, from the global generator. So that a clip is a function of its
latents alone (resume and replay decode it again bit for bit, whatever clips share the call),
pixrl draws both from a seed hashed from each clip's latents and decodes clip by clip; the
pipeline draws them from its sampling generator and the global one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .base import ModelLoadError
from .pipelines import PackedLatentsFamily, encodes_text
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime
from .wan import video_to_uint8

__all__ = ["LTXVideoConditioning", "LTXVideoFamily", "latent_seed"]


@dataclass
class LTXVideoConditioning:
    """T5 states padded to `max_sequence_length` with their attention mask, as the pipeline encodes."""

    prompt_embeds: torch.Tensor  # [B, L, 4096]
    mask: torch.Tensor  # [B, L] bool

    def select(self, idx) -> "LTXVideoConditioning":
        return LTXVideoConditioning(self.prompt_embeds[idx], self.mask[idx])

    def expand(self, n: int) -> "LTXVideoConditioning":
        return LTXVideoConditioning(self.prompt_embeds.expand(n, -1, -1), self.mask.expand(n, -1))


@register_family("ltx_video")
class LTXVideoFamily(PackedLatentsFamily):
    name = "ltx_video"
    pipeline_class = "LTXPipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    guidance = "cfg"
    video = True
    text_tokens = (1, 512)  # T5 tokens; the pipeline's 128 by default
    # the attention projections of self- and cross-attention in every block (diffusers' LTX-Video LoRAs)
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]
    default_frames = 161  # the pipeline's num_frames
    decode_batch = 1  # the decoder's injected noise is shared by a call's clips: one clip a call

    options = {"frame_rate": "frames per second the rotary time axis is scaled to (the pipeline's 25)",
               "decode_timestep": "the timestep a timestep-conditioned VAE decodes at (the pipeline's 0)",
               "decode_noise_scale": "the share of fresh noise mixed into the latents before decoding "
                                     "(default: decode_timestep, as the pipeline)"}

    def __init__(self, pipe, *args, frame_rate: float = 25.0, decode_timestep: float = 0.0,
                 decode_noise_scale: float | None = None, **kwargs):
        super().__init__(pipe, *args, **kwargs)
        self.frame_rate, self.decode_timestep = float(frame_rate), float(decode_timestep)
        self.decode_noise_scale = self.decode_timestep if decode_noise_scale is None else float(decode_noise_scale)
        if self.frame_rate <= 0:
            raise ModelLoadError(f"model.frame_rate={frame_rate}: must be positive (LTX-Video's clips play at 25)")
        if not self.vae.config.timestep_conditioning and (self.decode_timestep or self.decode_noise_scale):
            raise ModelLoadError(f"model.decode_timestep / model.decode_noise_scale: the VAE of {self.path!r} has no "
                                 "timestep conditioning (LTX-Video 0.9.0), so the pipeline ignores them; unset both")
        if not 0.0 <= self.decode_noise_scale <= 1.0:
            raise ModelLoadError(f"model.decode_noise_scale={self.decode_noise_scale}: a share of noise, in [0, 1]")
        self.set_clip_frames(pipe.vae_temporal_compression_ratio)

    @staticmethod
    def default_resolution(pipe) -> tuple[int, int]:
        return 512, 704  # the pipeline's default clip

    @staticmethod
    def resolution_multiple(pipe) -> int:
        return pipe.vae_spatial_compression_ratio * pipe.transformer_spatial_patch_size

    def describe(self) -> dict:
        return {"resolution": [self.height, self.width], "frames": self.frames, "mu": self._mu(),
                "shift_terminal": self.scheduler.config.get("shift_terminal"), "guidance": self.guidance,
                "frame_rate": self.frame_rate, "decode_timestep": self.decode_timestep,
                "decode_noise_scale": self.decode_noise_scale}

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> LTXVideoConditioning:
        return self.encode_text(prompts)

    def encode_text(self, prompts: list[str]) -> LTXVideoConditioning:
        """The pipeline's `encode_prompt` (T5 padded to max length, its mask kept); towers resident."""
        embeds, mask, _, _ = self.pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False,
                                                     max_sequence_length=self.max_sequence_length, device=self.device)
        return LTXVideoConditioning(embeds, mask)

    # --- dynamics -----------------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int, int]:
        h, w = self.latent_grid(self.pipe.vae_spatial_compression_ratio)
        frames = (self.frames - 1) // self.pipe.vae_temporal_compression_ratio + 1
        return self.transformer.config.in_channels, frames, h, w

    def _mu(self) -> float:
        """The dynamic shift's μ of the clip's latent token count, as the pipeline computes it."""
        from .pipelines import dynamic_shift_mu

        _, f, h, w = self.latent_shape()
        return dynamic_shift_mu(self.scheduler, f * h * w)

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: LTXVideoConditioning,
                 guidance_scale: float = 1.0, neg: LTXVideoConditioning | None = None) -> torch.Tensor:
        """v_θ(x, t | c) on video latents [B, C, F, H, W]; guidance_scale > 1: the pipeline's CFG
        (conditional pass, then the negative prompt's)."""
        b = x.shape[0]
        t = timestep.reshape(-1).to(x.device)
        t = t.expand(b) if t.numel() == 1 else t
        v = self._predict(x, t, cond)
        if guidance_scale > 1.0:
            if neg is None:
                raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
            v_u = self._predict(x, t, neg)
            v = v_u + guidance_scale * (v - v_u)
        return v

    def _predict(self, x: torch.Tensor, t: torch.Tensor, cond: LTXVideoConditioning) -> torch.Tensor:
        """One transformer pass on the packed tokens, unpacked back to [B, C, F, H, W] in float32."""
        pipe, dtype = self.pipe, self.transformer.dtype
        p, pt = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        _, _, f, h, w = x.shape
        tokens = pipe._pack_latents(x, p, pt).to(dtype)
        spatial = pipe.vae_spatial_compression_ratio
        out = self.transformer(hidden_states=tokens, encoder_hidden_states=cond.prompt_embeds.to(dtype), timestep=t,
                               encoder_attention_mask=cond.mask, num_frames=f // pt, height=h // p, width=w // p,
                               rope_interpolation_scale=(pipe.vae_temporal_compression_ratio / self.frame_rate,
                                                         spatial, spatial), return_dict=False)[0]
        return pipe._unpack_latents(out.float(), f // pt, h // p, w // p, p, pt)

    # --- pixels -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [B, C, F', H', W'] → uint8 clips [B, F, H, W, 3], each clip decoded alone
        with the randomness its latents seed (`latent_seed`)."""
        clips = []
        for z in latents:
            seed = latent_seed(z)
            noise = None
            if self.vae.config.timestep_conditioning:
                noise = torch.randn(z.shape, generator=torch.Generator().manual_seed(seed)).to(z.device)[None]
            clips.append(self.decode_clip(z[None], noise, seed))
        return np.concatenate(clips)

    @torch.no_grad()
    def decode_clip(self, z: torch.Tensor, noise: torch.Tensor | None, seed: int) -> np.ndarray:
        """The pipeline's decode of latents [1, C, F', H', W'] given its decode noise (`noise`) and
        the seed of the generator the VAE's injected noise reads (the global one, forked)."""
        pipe, vae = self.pipe, self.vae
        z = pipe._denormalize_latents(z.float(), vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        z = z.to(self.dtype)
        timestep = None
        if vae.config.timestep_conditioning:
            s = self.decode_noise_scale
            timestep = torch.tensor([self.decode_timestep], device=z.device, dtype=z.dtype)
            z = (1 - s) * z + s * noise.to(z.device, z.dtype)
        devices = [z.device] if z.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=z.device.type if devices else "cuda"):
            torch.manual_seed(seed)
            video = vae.decode(z.to(vae.dtype), timestep, return_dict=False)[0]
        return video_to_uint8(video)

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random LTX-Video-0.9.1-shaped pipeline (T5 with a SentencePiece-Unigram tokenizer, the
        video VAE ×4 in time and ×16 in space with a timestep-conditioned decoder that injects
        noise, latent mean/std, a 2-block DiT, LTX-Video's dynamic-shift Euler scheduler) with tiny
        widths. Returns the overrides that run it (64 px, 9 frames: 3 × 4 × 4 latents)."""
        import shutil

        from diffusers import LTXPipeline

        build = out_dir.parent / (out_dir.name + "_build")
        LTXPipeline(**tiny_parts(build, seed)).save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 64, "model.frames": 9,
                "model.max_sequence_length": 32, "model.decode_timestep": 0.03, "model.decode_noise_scale": 0.025}


def tiny_parts(build: Path, seed: int) -> dict:
    """Seeded tiny LTX-Video components (see `write_tiny`)."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel

    from .tiny_parts import t5_encoder, t5_tokenizer

    torch.manual_seed(seed)
    tok = t5_tokenizer(build / "tokenizer", 128)
    text_encoder = t5_encoder(tok, d_model=32)
    vae = AutoencoderKLLTXVideo(
        latent_channels=8, block_out_channels=(8, 16), down_block_types=("LTXVideoDownBlock3D",) * 2,
        layers_per_block=(1, 1, 1), spatio_temporal_scaling=(True, True), downsample_type=("conv", "conv"),
        decoder_block_out_channels=(8, 16), decoder_layers_per_block=(1, 1, 1),
        decoder_spatio_temporal_scaling=(True, True), decoder_inject_noise=(True, True, False),
        upsample_residual=(True, True), upsample_factor=(2, 2), timestep_conditioning=True)
    with torch.no_grad():  # trained checkpoints' statistics and noise scales are not the init's 0/1
        vae.latents_mean.copy_(torch.linspace(-0.3, 0.3, 8))
        vae.latents_std.copy_(torch.linspace(0.6, 1.8, 8))
        for name, p in vae.named_parameters():
            if "per_channel_scale" in name:
                p.copy_(0.1 * torch.randn_like(p))
    transformer = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2,
                                             attention_head_dim=12, cross_attention_dim=24, num_layers=2,
                                             caption_channels=32)
    return dict(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=ltx_scheduler())


def ltx_scheduler():
    """LTX-Video's flow-matching Euler scheduler (its released scheduler_config.json): the shift μ
    from the token count between 1024 (0.95) and 4096 (2.05), the grid stretched to end at 0.1."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(base_image_seq_len=1024, base_shift=0.95, max_image_seq_len=4096,
                                           max_shift=2.05, shift=1.0, shift_terminal=0.1, use_dynamic_shifting=True)


def latent_seed(z: torch.Tensor) -> int:
    """A 63-bit seed hashed from a clip's latents (float32 bytes): the same clip, the same seed."""
    digest = hashlib.blake2b(z.detach().float().cpu().contiguous().numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
