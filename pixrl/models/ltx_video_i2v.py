"""LTX-Video image-to-video: an LTX-Video checkpoint (the LTXPipeline layout; its text-to-video is
family `ltx_video`) animating each prompt's source image, as diffusers' LTXImageToVideoPipeline
runs it. Text, schedule, CFG and decode are the `ltx_video` family's; what image-to-video adds:

- the source is VAE-encoded alone (a one-frame clip) and normalised by the latent mean/std: the
  clean latents of the clip's first latent frame, which the pipeline keeps fixed while it steps
  the rest, its tokens at timestep 0 (`t·(1 − conditioning_mask)` per token);
- the first latent frame's velocity is the exact one towards that condition
  (models/held_frame.py): Euler lands on it, and that part of every transition holds no policy
  parameter; the transformer reads the condition there, as the pipeline's latents hold it.

Deviation: the pipeline draws the condition from the VAE's posterior with each sample's
generator; pixrl takes the posterior's mode, so a prompt's condition is one tensor whatever the
seed (it is encoded once, with the prompt). Given the same condition, the ODE equals the
pipeline's. Sources are resized to the clip's size (aspect kept, centre-cropped).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .held_frame import held_final, held_input, held_timesteps, held_velocity
from .ltx_video import LTXVideoConditioning, LTXVideoFamily
from .pipelines import encodes_text
from .registry import register_family
from .source_images import require_sources, source_pixels, write_prompt_images

__all__ = ["LTXVideoI2VConditioning", "LTXVideoI2VFamily"]


@dataclass
class LTXVideoI2VConditioning(LTXVideoConditioning):
    """The prompts' T5 states and mask plus each prompt's first-frame latents (None for the
    negative prompt, which borrows the rows' own)."""

    condition: torch.Tensor | None = None  # [B, C, 1, H', W']: the source's normalised latents

    def select(self, idx) -> "LTXVideoI2VConditioning":
        return LTXVideoI2VConditioning(self.prompt_embeds[idx], self.mask[idx],
                                       None if self.condition is None else self.condition[idx])

    def expand(self, n: int) -> "LTXVideoI2VConditioning":
        grow = (lambda v: None if v is None else v.expand(n, *v.shape[1:]))  # noqa: E731
        return LTXVideoI2VConditioning(grow(self.prompt_embeds), grow(self.mask), grow(self.condition))


@register_family("ltx_video_i2v")
class LTXVideoI2VFamily(LTXVideoFamily):
    name = "ltx_video_i2v"
    takes_images = True  # encode_prompts(prompts, images): each prompt's first frame
    needs_images = True  # image-to-video: every prompt has one
    image_use = "animates a first frame"  # what it does with them (errors say it)

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[bytes] | None = None) -> LTXVideoI2VConditioning:
        """The prompts' text states; with `images` (one per prompt), each prompt's first-frame
        latents. Without images: text alone, as the negative prompt is encoded."""
        text = self.encode_text(prompts)
        if images is None:
            return LTXVideoI2VConditioning(text.prompt_embeds, text.mask)
        require_sources(self, prompts, images)
        condition = torch.cat([self.first_frame(im) for im in images])
        return LTXVideoI2VConditioning(text.prompt_embeds, text.mask, condition)

    def first_frame(self, image: bytes) -> torch.Tensor:
        """[1, C, 1, H', W']: the source resized as the pipeline's video processor does, encoded
        as a one-frame clip (posterior mode), normalised as the pipeline's `prepare_latents`."""
        vae = self.vae
        _, pixels = source_pixels(self, image, vae.dtype)
        z = vae.encode(pixels.unsqueeze(2)).latent_dist.mode().float()
        return self.pipe._normalize_latents(z, vae.latents_mean, vae.latents_std)

    # --- dynamics -----------------------------------------------------------------------------
    #: the sampler's last act: the first latent frame set to the condition, as the pipeline ends
    final_latents = staticmethod(held_final)

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: LTXVideoI2VConditioning,
                 guidance_scale: float = 1.0, neg: LTXVideoConditioning | None = None) -> torch.Tensor:
        """v on video latents [B, C, F', H', W']: the transformer's (with the pipeline's CFG) on
        every latent frame but the first, whose velocity is the one towards its condition."""
        _, _, _, h, w = x.shape
        p = self.pipe.transformer_spatial_patch_size
        t, t_tokens = held_timesteps(self, x, timestep, cond, guidance_scale, neg, (h // p) * (w // p))
        hidden = held_input(x, cond.condition)
        v = self._predict(hidden, t_tokens, cond)
        if guidance_scale > 1.0:
            v_u = self._predict(hidden, t_tokens, neg)
            v = v_u + guidance_scale * (v - v_u)
        return held_velocity(x, cond.condition, v, t / self.scheduler.config.num_train_timesteps)

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """The tiny LTX-Video checkpoint (`LTXVideoFamily.write_tiny`) and a small prompt set of
        first frames beside it (`first_frames/prompts.jsonl`)."""
        from .wan_i2v import FIRST_FRAME_PROMPTS

        overrides = LTXVideoFamily.write_tiny(out_dir, seed)
        prompts = write_prompt_images(out_dir / "first_frames", FIRST_FRAME_PROMPTS, seed, stem="frame")
        return {**overrides, "model.family": cls.name, "dataset.name": "edits", "dataset.path": str(prompts),
                "dataset.heldout_path": "null", "dataset.categories": "null"}
