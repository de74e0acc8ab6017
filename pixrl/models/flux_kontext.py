"""FLUX.1 Kontext (dev): instruction editing. FLUX.1's transformer reads, after the noisy target
latents, the source image's latents as further tokens of the same sequence (image ids with
first coordinate 1), and its output over the target tokens is the velocity. Text conditioning,
schedule (dynamic shift of the target's sequence length), embedded guidance and decode are
FLUX.1's (models/flux.py), as FluxKontextPipeline has them.

The source image is resized to the family's size (aspect kept, centre-cropped) with
the pipeline's own image processor and encoded by the VAE at its posterior mode, as the pipeline
does (`_encode_vae_image`, sample_mode="argmax"), so the conditioning is deterministic and replays
bit for bit. The pipeline keeps a source's aspect at one of Kontext's preferred resolutions; for a
source of the family's size the two agree. Rollouts
of a prompt with no image are refused: Kontext edits. (The pipeline's optional IP-adapter image
encoder is not loaded.) LoRA targets: FLUX.1's, which flow_grpo's Kontext script also trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .flux import FluxConditioning, FluxFamily
from .pipelines import encodes_text
from .registry import register_family
from .source_images import decode_rgb, require_sources, write_prompt_images

__all__ = ["FluxKontextConditioning", "FluxKontextFamily"]


@dataclass
class FluxKontextConditioning(FluxConditioning):
    """FLUX.1's text conditioning plus the source image: its packed latents and their ids."""

    image_latents: torch.Tensor = None  # [B, L_img, 4C]
    image_ids: torch.Tensor = None  # [L_img, 3], first coordinate 1; shared by the batch

    def select(self, idx) -> "FluxKontextConditioning":
        return FluxKontextConditioning(self.prompt_embeds[idx], self.pooled[idx], self.text_ids,
                                       self.image_latents[idx], self.image_ids)

    def expand(self, n: int) -> "FluxKontextConditioning":
        return FluxKontextConditioning(self.prompt_embeds.expand(n, -1, -1), self.pooled.expand(n, -1),
                                       self.text_ids, self.image_latents.expand(n, -1, -1), self.image_ids)


@register_family("flux1_kontext")
class FluxKontextFamily(FluxFamily):
    name = "flux1_kontext"
    pipeline_class = "FluxKontextPipeline"
    takes_images = True  # encode_prompts(prompts, images): each prompt edits its source image
    needs_images = True  # and every prompt has one: Kontext only edits
    image_use = "edits images"  # what it does with them (errors say it)

    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[bytes] | None = None) -> FluxKontextConditioning:
        require_sources(self, prompts, images)
        text = self.encode_text(prompts)
        latents = torch.cat([self._image_latents(im) for im in images])
        _, c, h, w = latents.shape
        packed = self.pipe._pack_latents(latents, len(images), c, h, w)
        ids = self.pipe._prepare_latent_image_ids(1, h // 2, w // 2, self.device, latents.dtype)
        ids[..., 0] = 1
        return FluxKontextConditioning(text.prompt_embeds, text.pooled, text.text_ids, packed, ids)

    def _image_latents(self, image: bytes) -> torch.Tensor:
        """[1, C, h, w]: the source image at the family's size (aspect kept, centre-cropped),
        VAE-encoded at its mode, shifted and scaled (FluxKontextPipeline's `_encode_vae_image`)."""
        pixels = self.pipe.image_processor.preprocess(decode_rgb(image), self.height, self.width, resize_mode="crop")
        return self.pipe._encode_vae_image(pixels.to(self.device, self.vae.dtype), generator=None)

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: FluxKontextConditioning,
                 guidance_scale: float = 1.0, neg: FluxKontextConditioning | None = None) -> torch.Tensor:
        """v_θ over the target tokens of [target; source] sequences, on unpacked latents [B, C, H, W]."""
        return self.denoise(x, timestep, cond, guidance_scale, cond.image_latents, cond.image_ids)

    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random FLUX.1-Kontext-dev-shaped pipeline (FLUX.1's tiny parts, saved as a
        FluxKontextPipeline), with a tiny editing prompt set beside it (`edits.jsonl` and its
        images). Returns the overrides that run it."""
        overrides = super().write_tiny(out_dir, seed)
        prompts = write_edit_prompts(out_dir / "edits", seed)
        return {**overrides, "model.family": cls.name, "dataset.name": "edits", "dataset.path": str(prompts),
                "dataset.heldout_path": "null", "dataset.categories": "null"}


def write_edit_prompts(folder: Path, seed: int = 0, n: int = 4) -> Path:
    """A small editing prompt set: `n` random 32 px source images (PNG) and a JSONL of
    instructions naming them (`edits.jsonl`); returns the JSONL's path."""
    verbs = ["make the sky red", "add a blue square", "turn it into a sketch", "remove the circle"]
    return write_prompt_images(folder, verbs, seed, n, jsonl="edits.jsonl")
