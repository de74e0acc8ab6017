"""HunyuanVideo-1.5 image-to-video (HunyuanVideo15ImageToVideoPipeline): the text-to-video family
(models/hunyuan_video15.py) with each prompt's source image as the clip's first frame, read as the
pipeline reads it —

- its VAE latents (posterior mode, times the VAE's scaling factor) in the first latent frame of
  the condition channels, zeros after, and a mask of ones over that frame (the channels text-to-
  video leaves zero);
- its SigLIP vision states (the last hidden state, 729 × 1152 for the released encoder) as the
  transformer's image embeddings.

CFG's unconditional pass keeps both and swaps only the text, as the pipeline's guider does. The
source is resized to the clip's size (aspect kept, centre-cropped) with the
pipeline's own processor; the pipeline picks a size bucket from the source's aspect around the
transformer's `target_size` — where that bucket is the clip's size, the two agree. SigLIP reads the
same resized picture, as in the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .hunyuan_video15 import HunyuanVideo15Conditioning, HunyuanVideo15Family
from .pipelines import encodes_text
from .registry import register_family
from .source_images import SourceImageError, decode_rgb, require_sources, write_prompt_images

__all__ = ["HunyuanVideo15I2VConditioning", "HunyuanVideo15I2VFamily"]


@dataclass
class HunyuanVideo15I2VConditioning(HunyuanVideo15Conditioning):
    """The text conditioning plus each prompt's first frame (None for the negative prompt, which
    borrows the rows' own)."""

    image_latents: torch.Tensor | None = None  # [B, C, 1, H', W'] scaled VAE latents of the frame
    image_embeds: torch.Tensor | None = None  # [B, N, D] SigLIP last hidden state

    def select(self, idx) -> "HunyuanVideo15I2VConditioning":
        return HunyuanVideo15I2VConditioning(*(None if v is None else v[idx] for v in self._fields()))

    def expand(self, n: int) -> "HunyuanVideo15I2VConditioning":
        return HunyuanVideo15I2VConditioning(*(None if v is None else v.expand(n, *v.shape[1:])
                                               for v in self._fields()))

    def _fields(self) -> tuple:
        return (self.prompt_embeds, self.mask, self.glyph_embeds, self.glyph_mask, self.image_latents,
                self.image_embeds)

    def with_text(self, text: HunyuanVideo15Conditioning) -> "HunyuanVideo15I2VConditioning":
        """These rows' first frames under other prompts (CFG's unconditional pass)."""
        return HunyuanVideo15I2VConditioning(text.prompt_embeds, text.mask, text.glyph_embeds, text.glyph_mask,
                                             self.image_latents, self.image_embeds)


@register_family("hunyuan_video15_i2v")
class HunyuanVideo15I2VFamily(HunyuanVideo15Family):
    name = "hunyuan_video15_i2v"
    pipeline_class = "HunyuanVideo15ImageToVideoPipeline"
    takes_images = True  # encode_prompts(prompts, images): each prompt's first frame
    needs_images = True
    image_use = "animates a first frame"  # what it does with them (errors say it)
    conditioning_towers = ("text_encoder", "image_encoder")

    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[bytes] | None = None) -> HunyuanVideo15I2VConditioning:
        """The prompts' text conditioning; with `images` (one per prompt) each one's first frame.
        Without images: text alone, as the negative prompt is encoded."""
        text = self.encode_text(prompts)
        if images is None:
            return HunyuanVideo15I2VConditioning(text.prompt_embeds, text.mask, text.glyph_embeds, text.glyph_mask)
        require_sources(self, prompts, images)
        frames = [self._first_frame(im) for im in images]
        return HunyuanVideo15I2VConditioning(text.prompt_embeds, text.mask, text.glyph_embeds, text.glyph_mask,
                                             torch.cat([lat for lat, _ in frames]), torch.cat([e for _, e in frames]))

    def _first_frame(self, image: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        """([1, C, 1, H', W'] scaled latents, [1, N, D] SigLIP states) of one source image, with the
        pipeline's own `_get_image_latents` and `_get_image_embeds`."""
        h, w, pipe = self.height, self.width, self.pipe
        picture = pipe.video_processor.resize(decode_rgb(image), height=h, width=w, resize_mode="crop")
        latents = pipe._get_image_latents(pipe.vae, pipe.video_processor, picture, h, w, self.device)
        embeds = pipe._get_image_embeds(pipe.image_encoder, pipe.feature_extractor, picture, self.device)
        return latents, embeds

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: HunyuanVideo15I2VConditioning,
                 guidance_scale: float = 1.0, neg: HunyuanVideo15Conditioning | None = None) -> torch.Tensor:
        if cond.image_latents is None:
            raise SourceImageError(f"the {self.name} family animates a first frame: these prompts were encoded "
                                   "without source images")
        return super().velocity(x, timestep, cond, guidance_scale, None if neg is None else cond.with_text(neg))

    def _inputs(self, x: torch.Tensor, cond: HunyuanVideo15I2VConditioning) -> tuple[torch.Tensor, torch.Tensor]:
        """[latents; the first frame's latents then zeros; a mask of ones over the first latent frame]
        and the frame's SigLIP states, as the pipeline's `prepare_cond_latents_and_mask` builds them."""
        dtype = self.transformer.dtype
        first = cond.image_latents.to(x.dtype)
        condition = torch.cat([first, first.new_zeros(*first.shape[:2], x.shape[2] - 1, *first.shape[3:])], dim=2)
        mask = torch.zeros_like(x[:, :1])
        mask[:, :, 0] = 1.0
        hidden = torch.cat([x.to(dtype), condition.to(dtype), mask.to(dtype)], dim=1)
        return hidden, cond.image_embeds.to(dtype)

    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random HunyuanVideo-1.5-I2V-shaped pipeline: the text-to-video family's tiny parts
        with a tiny SigLIP vision tower and its processor, the transformer's target size at the
        tiny resolution (64 px), and a few first frames beside it (`first_frames/prompts.jsonl`)."""
        import shutil

        from diffusers import HunyuanVideo15ImageToVideoPipeline
        from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

        from .hunyuan_video15 import tiny_parts
        from .wan_i2v import FIRST_FRAME_PROMPTS

        build = out_dir.parent / (out_dir.name + "_build")
        parts = tiny_parts(build, seed, task_type="i2v", target_size=64)
        siglip = SiglipVisionModel(SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                      num_attention_heads=2, image_size=32, patch_size=8))
        HunyuanVideo15ImageToVideoPipeline(
            **parts, image_encoder=siglip,
            feature_extractor=SiglipImageProcessor(size={"height": 32, "width": 32})).save_pretrained(
            str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        prompts = write_prompt_images(out_dir / "first_frames", FIRST_FRAME_PROMPTS, seed, stem="frame", size=64)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 64, "model.frames": 5,
                "model.max_sequence_length": 64, "dataset.name": "edits", "dataset.path": str(prompts),
                "dataset.heldout_path": "null", "dataset.categories": "null"}
