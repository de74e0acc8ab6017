"""CogVideoX image-to-video (CogVideoXImageToVideoPipeline: CogVideoX1.5-5B-I2V, and CogVideoX-5B-I2V
at its native 480×720 only): each prompt's source image as the clip's first frame. The variance-
preserving dynamics, text, CFG and decode are the `cogvideox` family's; what image-to-video adds,
as the pipeline builds it: the source encoded as a one-frame clip, scaled by the VAE's factor (its
inverse where the checkpoint says `invert_scale_latents`), followed by zero latents for the other
frames (frame-major, the 1.5 padding included), read by the transformer beside the noisy latents
in channels (16 + 16); the 1.5 transformer's `ofs` embedding at 2.0, as the pipeline gives it.

Deviation: the pipeline samples the source's VAE posterior with each sample's generator; pixrl
takes its mode, so a prompt's condition is one tensor whatever the seed. Given that condition the
ODE equals the pipeline's. CogVideoX-5B-I2V's learned positional embeddings hold one size
(480×720, its default here): any other size is refused, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .base import ModelLoadError
from .cogvideox import CogVideoXConditioning, CogVideoXFamily
from .pipelines import encodes_text
from .registry import register_family
from .source_images import SourceImageError, require_sources, source_pixels, write_prompt_images

__all__ = ["CogVideoXI2VConditioning", "CogVideoXI2VFamily"]


@dataclass
class CogVideoXI2VConditioning(CogVideoXConditioning):
    """The prompts' T5 states plus each prompt's first-frame condition (None for the negative)."""

    condition: torch.Tensor | None = None  # [B, F', C, H', W']: the source's latents, then zeros

    def select(self, idx) -> "CogVideoXI2VConditioning":
        return CogVideoXI2VConditioning(self.prompt_embeds[idx], None if self.condition is None else self.condition[idx])

    def expand(self, n: int) -> "CogVideoXI2VConditioning":
        grow = (lambda v: None if v is None else v.expand(n, *v.shape[1:]))  # noqa: E731
        return CogVideoXI2VConditioning(grow(self.prompt_embeds), grow(self.condition))


@register_family("cogvideox_i2v")
class CogVideoXI2VFamily(CogVideoXFamily):
    name = "cogvideox_i2v"
    pipeline_class = "CogVideoXImageToVideoPipeline"
    takes_images = True  # encode_prompts(prompts, images): each prompt's first frame
    needs_images = True  # image-to-video: every prompt has one
    image_use = "animates a first frame"  # what it does with them (errors say it)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        c = self.transformer.config
        if c.in_channels != 2 * self.vae.config.latent_channels:
            raise ModelLoadError(f"{self.path!r}: its transformer reads {c.in_channels} channels; image-to-video reads "
                                 f"{2 * self.vae.config.latent_channels} (latents + first-frame latents) — is it a "
                                 "text-to-video checkpoint? (model.family=cogvideox)")

    def latent_shape(self) -> tuple[int, int, int, int]:
        frames, _, h, w = super().latent_shape()
        return frames, self.vae.config.latent_channels, h, w

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[bytes] | None = None) -> CogVideoXI2VConditioning:
        text = self.encode_text(prompts)
        if images is None:
            return CogVideoXI2VConditioning(text.prompt_embeds)
        require_sources(self, prompts, images)
        return CogVideoXI2VConditioning(text.prompt_embeds, torch.cat([self.first_frame(im) for im in images]))

    def first_frame(self, image: bytes) -> torch.Tensor:
        """[1, F', C, H', W'] as the pipeline's `prepare_latents` builds it, from the posterior's mode."""
        vae = self.vae
        _, pixels = source_pixels(self, image, vae.dtype)
        z = vae.encode(pixels.unsqueeze(2)).latent_dist.mode().float().permute(0, 2, 1, 3, 4)
        sf = vae.config.scaling_factor
        z = z / sf if vae.config.invert_scale_latents else z * sf
        frames, channels, h, w = self.latent_shape()
        return torch.cat([z, z.new_zeros(1, frames - 1, channels, h, w)], dim=1)

    # --- the transformer's v ------------------------------------------------------------------
    def unet_output(self, x_t: torch.Tensor, t: torch.Tensor, *conds: CogVideoXI2VConditioning) -> torch.Tensor:
        """The transformer's v for x_t [B, F, C, H, W] beside each row's first-frame condition."""
        rows = conds[-1].condition  # the prompts' own; CFG's negative (first) borrows them, as the pipeline's
        if rows is None:
            raise SourceImageError(f"the {self.name} family animates a first frame: these prompts were encoded without "
                                   "source images")
        dtype = self.transformer.dtype
        condition = torch.cat([rows] * len(conds))
        embeds = torch.cat([c.prompt_embeds for c in conds]).to(dtype)
        hidden = torch.cat([x_t, condition.to(x_t.dtype)], dim=2).to(dtype)
        ofs = None if self.transformer.config.ofs_embed_dim is None else hidden.new_full((1,), 2.0)
        return self.transformer(hidden_states=hidden, encoder_hidden_states=embeds, timestep=t, ofs=ofs,
                                image_rotary_emb=self._rotary_table(x_t.device), return_dict=False)[0].float()

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random CogVideoX1.5-I2V-shaped pipeline (the text-to-video tiny's parts, a transformer
        reading 4 + 4 channels with a 2-frame temporal patch and the `ofs` embedding) and a small
        prompt set of first frames beside it (`first_frames/prompts.jsonl`)."""
        import shutil

        from diffusers import CogVideoXImageToVideoPipeline

        from .wan_i2v import FIRST_FRAME_PROMPTS

        build = out_dir.parent / (out_dir.name + "_t2v")
        overrides = CogVideoXFamily.write_tiny(build, seed, in_channels=8, patch_size_t=2, ofs_embed_dim=16)
        t2v = CogVideoXFamily.load(build, max_sequence_length=64, resolution=32, frames=9)
        CogVideoXImageToVideoPipeline(**t2v.pipe.components).save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        prompts = write_prompt_images(out_dir / "first_frames", FIRST_FRAME_PROMPTS, seed, stem="frame")
        return {**overrides, "model.family": cls.name, "model.path": str(out_dir), "dataset.name": "edits",
                "dataset.path": str(prompts), "dataset.heldout_path": "null", "dataset.categories": "null"}
