"""LTX-2 image-to-audio+video: an LTX-2 checkpoint (the LTX2Pipeline layout; its text-to-video is
family `ltx2`) animating each prompt's source image and sounding it, as diffusers'
LTX2ImageToVideoPipeline runs it. Text, schedule, the joint video+audio latent, every guidance
term and decode are the `ltx2` family's; what image-to-video adds:

- the source is re-compressed as one H.264 frame at the checkpoint's CRF (33 for Gemma-3
  checkpoints: the compression LTX-2 was trained against; `model.image_crf`, 0 skips it), resized
  to the clip, VAE-encoded alone (a one-frame clip, posterior mode) and normalised: the clean
  tokens of the clip's first latent frame, which the pipeline keeps fixed while it steps the rest
  — given to the DiT at timestep 0 (`t·(1 − conditioning_mask)` per video token) while the
  soundtrack's tokens take the step's timestep;
- every guidance term is combined over the whole video stream as the pipeline does (the rescale's
  standard deviation includes the held frame's tokens), then the first frame's velocity is the
  exact one towards the condition (models/held_frame.py's rule on tokens): Euler lands on it, and
  that part of every transition holds no policy parameter.

Deviation: the pipeline draws the condition from the VAE's posterior with each sample's
generator ("argmax": its mode — the same); sources are resized to the clip's size with the aspect
kept and centre-cropped, where the pipeline stretches. Given the same picture, the ODE equals the
pipeline's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .ltx2 import LTX2Conditioning, LTX2Family
from .pipelines import encodes_text
from .registry import register_family
from .source_images import SourceImageError, require_sources, source_pixels, write_prompt_images

__all__ = ["LTX2I2VConditioning", "LTX2I2VFamily"]


@dataclass
class LTX2I2VConditioning(LTX2Conditioning):
    """The connectors' prompt sequences plus each prompt's first-frame tokens (None for the
    negative prompt, which borrows the rows' own)."""

    condition: torch.Tensor | None = None  # [B, tokens of one latent frame, D]: packed, normalised

    def select(self, idx) -> "LTX2I2VConditioning":
        return LTX2I2VConditioning(self.video[idx], self.audio[idx], self.mask[idx],
                                   None if self.condition is None else self.condition[idx])

    def expand(self, n: int) -> "LTX2I2VConditioning":
        grow = (lambda v: None if v is None else v.expand(n, *v.shape[1:]))  # noqa: E731
        return LTX2I2VConditioning(grow(self.video), grow(self.audio), grow(self.mask), grow(self.condition))


@register_family("ltx2_i2v")
class LTX2I2VFamily(LTX2Family):
    name = "ltx2_i2v"
    takes_images = True  # encode_prompts(prompts, images): each prompt's first frame
    needs_images = True  # image-to-video: every prompt has one
    image_use = "animates a first frame"  # what it does with them (errors say it)
    options = {**LTX2Family.options,
               "image_crf": "H.264 CRF the source is re-compressed at before encoding (the pipeline's default for the "
                            "checkpoint's text encoder: 33 for Gemma-3; 0: not re-compressed)"}

    def __init__(self, pipe, *args, image_crf: int | None = None, **kwargs):
        from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

        super().__init__(pipe, *args, **kwargs)
        encoder = pipe.text_encoder or self._text_encoder_config()  # (a rank loaded without its text towers)
        self.image_crf = int(resolve_default_image_crf(encoder) if image_crf is None else image_crf)
        _, h, w = self._video_grid()
        p = pipe.transformer_spatial_patch_size
        self.frame_tokens = (h // p) * (w // p) * pipe.transformer_temporal_patch_size  # tokens of one latent frame

    def _text_encoder_config(self):
        """The checkpoint's text-encoder config as an object with `config.model_type` (what the
        pipeline's CRF default reads), from its config.json."""
        import json
        from types import SimpleNamespace

        cfg = Path(self.path) / "text_encoder" / "config.json"
        model_type = json.loads(cfg.read_text()).get("model_type") if cfg.is_file() else None
        return SimpleNamespace(config=SimpleNamespace(model_type=model_type))

    def describe(self) -> dict:
        return {**super().describe(), "image_crf": self.image_crf}

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[bytes] | None = None) -> LTX2I2VConditioning:
        """The prompts' text sequences; with `images` (one per prompt), each prompt's first-frame
        tokens. Without images: text alone, as the negative prompt is encoded."""
        text = self.encode_text(prompts)
        if images is None:
            return LTX2I2VConditioning(text.video, text.audio, text.mask)
        require_sources(self, prompts, images)
        condition = torch.cat([self.first_frame(im) for im in images])
        return LTX2I2VConditioning(text.video, text.audio, text.mask, condition)

    def first_frame(self, image: bytes) -> torch.Tensor:
        """[1, tokens, D]: the source resized to the clip, re-compressed at `image_crf`, read by
        the pipeline's video processor, encoded as a one-frame clip (posterior mode), normalised
        and packed as the pipeline's `prepare_latents` does."""
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf
        from PIL import Image

        vae, pipe = self.vae, self.pipe
        picture, pixels = source_pixels(self, image, vae.dtype)
        if self.image_crf:
            picture = Image.fromarray(apply_image_conditioning_crf(np.asarray(picture), self.image_crf))
            pixels = pipe.video_processor.preprocess(picture, height=self.height, width=self.width)
            pixels = pixels.to(self.device, vae.dtype)
        z = vae.encode(pixels.unsqueeze(2)).latent_dist.mode().float()
        z = pipe._normalize_latents(z, vae.latents_mean, vae.latents_std)
        return pipe._pack_latents(z, pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)

    # --- dynamics -----------------------------------------------------------------------------
    def final_latents(self, x: torch.Tensor, cond: LTX2I2VConditioning) -> torch.Tensor:
        """The sampled joint latents with the first frame's tokens set to each row's condition, as
        the pipeline leaves them (the sampler's last act)."""
        return self._held(x, cond.condition)

    def _held(self, x: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        n = self.frame_tokens
        return torch.cat([condition.to(x.device, x.dtype), x[:, n:]], dim=1)

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: LTX2I2VConditioning,
                 guidance_scale: float = 1.0, neg: LTX2Conditioning | None = None) -> torch.Tensor:
        """v on the joint latents: the DiT's with the pipeline's guidance on every token but the
        first frame's, which read the condition at timestep 0 and move towards it at (x − c)/σ."""
        if cond.condition is None:
            raise SourceImageError(f"the {self.name} family animates a first frame: these prompts were encoded "
                                   "without source images")
        t = self.row_timesteps(x, timestep, guidance_scale, neg)
        n = self.frame_tokens
        held = self._held(x, cond.condition)
        xv, xa = self.split(held)
        video_t = t[:, None].expand(x.shape[0], xv.shape[1]).clone()
        video_t[:, :n] = 0  # the condition frame's tokens are clean
        v, a = self.guided(xv, xa, t, cond, guidance_scale, neg, video_t=video_t)
        sigma = (t.float() / self.scheduler.config.num_train_timesteps).view(-1, 1, 1)
        toward = (x[:, :n].float() - cond.condition.to(x.device).float()) / sigma
        return torch.cat([toward, v[:, n:], a], dim=1)

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0, variant: str = "2.3") -> dict:
        """The tiny LTX-2 checkpoint (`LTX2Family.write_tiny`) and a small prompt set of first
        frames beside it (`first_frames/prompts.jsonl`)."""
        from .wan_i2v import FIRST_FRAME_PROMPTS

        overrides = LTX2Family.write_tiny(out_dir, seed, variant)
        prompts = write_prompt_images(out_dir / "first_frames", FIRST_FRAME_PROMPTS, seed, stem="frame")
        return {**overrides, "model.family": cls.name, "dataset.name": "edits", "dataset.path": str(prompts),
                "dataset.heldout_path": "null", "dataset.categories": "null"}
