"""SkyReels-V1-Hunyuan-I2V: HunyuanVideo fine-tuned to animate a first frame (diffusers
HunyuanSkyreelsImageToVideoPipeline), the image-to-video model DanceGRPO trains beside
HunyuanVideo. Text towers, schedule, shift and decode are the text-to-video family's
(models/hunyuan_video.py); what it adds, as the pipeline computes it:

- the first frame is VAE-encoded, scaled, and followed by zero latent frames; the transformer
  reads [noisy latents; frame latents] concatenated in channels (16 + 16 = 32);
- guidance is true CFG on the empty prompt (`sampling.guidance_scale`; the pipeline's
  `true_cfg_scale`, 6 in its example), the unconditional pass keeping the frame; the embedded
  guidance stays at the pipeline's 1.0.

Deviation: the pipeline draws the frame's latents as a posterior sample from the clip's own
generator, before the noise; here they are the posterior mode, so a prompt's condition is fixed
by its source image (as every image-conditioned family's is) and needs no storing per rollout.
The parity test gives the pipeline the mode too. The source is resized to the clip's size
(aspect kept, centre-cropped).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .base import ModelLoadError
from .hunyuan_video import HunyuanVideoConditioning, HunyuanVideoFamily, tiny_parts
from .pipelines import encodes_text
from .registry import register_family
from .source_images import SourceImageError, require_sources, source_pixels, write_prompt_images
from .wan_i2v import FIRST_FRAME_PROMPTS

__all__ = ["SkyReelsI2VConditioning", "SkyReelsI2VFamily"]


@dataclass
class SkyReelsI2VConditioning(HunyuanVideoConditioning):
    """The prompts' text states plus each prompt's first-frame latents (None for the negative
    prompt, which borrows the rows' own)."""

    condition: torch.Tensor | None = None  # [B, C, F', H', W']: the frame's latents, then zeros

    def select(self, idx) -> "SkyReelsI2VConditioning":
        return SkyReelsI2VConditioning(self.prompt_embeds[idx], self.mask[idx], self.pooled[idx],
                                       None if self.condition is None else self.condition[idx])

    def expand(self, n: int) -> "SkyReelsI2VConditioning":
        text = super().expand(n)
        cond = None if self.condition is None else self.condition.expand(n, *self.condition.shape[1:])
        return SkyReelsI2VConditioning(text.prompt_embeds, text.mask, text.pooled, cond)

    def with_text(self, text: HunyuanVideoConditioning) -> "SkyReelsI2VConditioning":
        """These rows' first frames under other prompts (CFG's unconditional pass)."""
        return SkyReelsI2VConditioning(text.prompt_embeds, text.mask, text.pooled, self.condition)


@register_family("skyreels_i2v")
class SkyReelsI2VFamily(HunyuanVideoFamily):
    name = "skyreels_i2v"
    pipeline_class = "HunyuanSkyreelsImageToVideoPipeline"
    guidance = "cfg"  # true CFG on the empty prompt; the embedded scale stays 1
    takes_images = True  # encode_prompts(prompts, images): each prompt's first frame
    needs_images = True  # image-to-video: every prompt has one
    image_use = "animates a first frame"  # what it does with them (errors say it)
    default_frames = 97  # the pipeline's num_frames
    EMBEDDED = 1.0  # the pipeline's guidance_scale

    def __init__(self, pipe, *args, **kwargs):
        super().__init__(pipe, *args, **kwargs)
        c = self.transformer.config
        if c.in_channels != 2 * c.out_channels:
            raise ModelLoadError(f"{self.path!r}: its transformer reads {c.in_channels} channels; SkyReels image-to-video "
                                 f"reads {2 * c.out_channels} (latents and first-frame latents, {c.out_channels} each) "
                                 "— is it a text-to-video checkpoint? (model.family=hunyuan_video)")

    @staticmethod
    def default_resolution(pipe) -> tuple[int, int]:
        return 544, 960  # the pipeline's default clip

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[bytes] | None = None) -> SkyReelsI2VConditioning:
        """The prompts' text states; with `images` (one per prompt), each prompt's first-frame
        latents. Without images: text alone, as the negative prompt is encoded."""
        text = self.encode_text(prompts)
        if images is None:
            return SkyReelsI2VConditioning(text.prompt_embeds, text.mask, text.pooled)
        require_sources(self, prompts, images)
        condition = torch.cat([self._first_frame(im) for im in images])
        return SkyReelsI2VConditioning(text.prompt_embeds, text.mask, text.pooled, condition)

    def _first_frame(self, image: bytes) -> torch.Tensor:
        """[1, C, F', H', W']: the pipeline's `image_latents` of one source image (posterior mode,
        × the VAE's scaling factor, then F' − 1 zero frames)."""
        _, pixels = source_pixels(self, image, self.vae.dtype)
        latents = self.vae.encode(pixels.unsqueeze(2)).latent_dist.mode().float() * self.vae.config.scaling_factor
        c, frames, h, w = self.latent_shape()
        return torch.cat([latents, latents.new_zeros(1, c, frames - 1, h, w)], dim=2)

    # --- dynamics -----------------------------------------------------------------------------
    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: SkyReelsI2VConditioning,
                 guidance_scale: float = 1.0, neg: HunyuanVideoConditioning | None = None) -> torch.Tensor:
        """v_θ on video latents [B, C, F', H', W'] given each row's first frame; guidance_scale > 1:
        true CFG, the unconditional pass keeping the rows' frames under the negative prompt."""
        if cond.condition is None:
            raise SourceImageError(f"the {self.name} family animates a first frame: these prompts were encoded without "
                                   "source images")
        hidden = torch.cat([x, cond.condition.to(x.dtype)], dim=1)
        v = self._predict(hidden, timestep, cond, self.EMBEDDED)
        if guidance_scale > 1.0:
            if neg is None:
                raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
            v_u = self._predict(hidden, timestep, cond.with_text(neg), self.EMBEDDED)
            v = v_u + guidance_scale * (v - v_u)
        return v

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """HunyuanVideo's tiny parts with a transformer reading latents + first-frame latents
        (4 + 4 channels), saved as a HunyuanSkyreelsImageToVideoPipeline, and a small prompt set of
        first frames beside it (`first_frames/prompts.jsonl`)."""
        import shutil

        from diffusers import HunyuanSkyreelsImageToVideoPipeline

        build = out_dir.parent / (out_dir.name + "_build")
        parts = tiny_parts(build, seed, in_channels=8, out_channels=4)
        HunyuanSkyreelsImageToVideoPipeline(**parts).save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        prompts = write_prompt_images(out_dir / "first_frames", FIRST_FRAME_PROMPTS, seed, stem="frame")
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32, "model.frames": 5,
                "model.max_sequence_length": 64, "dataset.name": "edits", "dataset.path": str(prompts),
                "dataset.heldout_path": "null", "dataset.categories": "null"}
