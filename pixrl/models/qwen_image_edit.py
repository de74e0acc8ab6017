"""Qwen-Image-Edit: instruction editing on Qwen-Image (its MMDiT, VAE, scheduler and true CFG,
models/qwen_image.py), as QwenImageEditPipeline computes it:

- the source image is resized to the pipeline's editing size — 1024·1024 pixels at the source's
  aspect ratio, on the 32-pixel grid (`calculate_dimensions`); pixrl centre-crops a source to the
  target's aspect first, so a batch shares one size (for a source of that aspect the two agree);
- the prompt is encoded by Qwen2.5-VL *with the source image*: the edit template (a system turn,
  then the image and the instruction), its first 64 tokens dropped, padding masked;
- the source's VAE latents (posterior mode, normalised by the latent mean/std) follow the noisy
  target latents as further tokens of the sequence, with their own entry in `img_shapes`; the
  velocity is the output over the target tokens;
- true CFG: the negative prompt is encoded with each row's source image too, so its conditioning
  differs per row (`negative_reads_images`), then the norm-rescaled combination of qwen_image.

One deviation, deliberate: the image tokens are placed on Qwen2.5-VL's M-RoPE grid, as the model
computes them when its processor's `mm_token_type_ids` reach it. QwenImageEditPipeline (diffusers
0.42) passes the text encoder only ids, mask, pixels and grid, and transformers 5 then quietly
gives every token a plain sequential position (transformers 4, which Qwen-Image-Edit was released
with, derived the grid from the ids); tests/test_qwen_image_edit_family.py measures the difference.
The transformer is then given exactly the pipeline's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .pipelines import encodes_text
from .qwen_image import QwenImageConditioning, QwenImageFamily
from .registry import register_family
from .source_images import crop_to_aspect, decode_rgb, require_sources

__all__ = ["QwenImageEditConditioning", "QwenImageEditFamily"]

EDIT_AREA = 1024 * 1024  # the pipeline's source size: calculate_dimensions(1024 * 1024, ratio)


@dataclass
class QwenImageEditConditioning(QwenImageConditioning):
    """The instruction encoded with its source image, plus the source's packed latents."""

    image_latents: torch.Tensor = None  # [B, L_src, 4C]
    source_grid: tuple[int, int] = (0, 0)  # the source's packed (h, w): its img_shapes entry

    def select(self, idx) -> "QwenImageEditConditioning":
        base = super().select(idx)
        return QwenImageEditConditioning(base.prompt_embeds, base.mask, self.image_latents[idx], self.source_grid)

    def expand(self, n: int) -> "QwenImageEditConditioning":
        base = super().expand(n)
        return QwenImageEditConditioning(base.prompt_embeds, base.mask, self.image_latents.expand(n, -1, -1),
                                         self.source_grid)


def edit_size(width: int, height: int, area: int = EDIT_AREA) -> tuple[int, int]:
    """(width, height) of the pipeline's `calculate_dimensions(area, width / height)`."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    w, h, _ = calculate_dimensions(area, width / height)
    return int(w), int(h)


@register_family("qwen_image_edit")
class QwenImageEditFamily(QwenImageFamily):
    name = "qwen_image_edit"
    pipeline_class = "QwenImageEditPipeline"
    takes_images = True  # encode_prompts(prompts, images): each instruction edits its source image
    needs_images = True  # and every prompt has one
    image_use = "edits images"
    negative_reads_images = True  # CFG's negative prompt is encoded with each row's source image
    vl_area = EDIT_AREA  # the source's area as Qwen2.5-VL reads it
    vae_area = EDIT_AREA  # and as the VAE encodes it into the sequence
    image_prompt = ""  # what precedes the instruction in the user turn (the template holds the image here)

    @staticmethod
    def swap_components(path: Path) -> dict:
        """The checkpoint's Qwen2VLProcessor, which transformers builds only with torchvision (its video
        processor): what it computes, from the same files (models/qwen_vl_processor.py)."""
        from .qwen_vl_processor import QwenVLProcessor

        return {"processor": lambda: QwenVLProcessor.from_pretrained(path / "processor")}

    # --- conditioning -------------------------------------------------------------------------
    def source(self, image: bytes, area: int = EDIT_AREA):
        """The source as the pipeline reads it: centre-cropped to the target's aspect (so a batch's
        sources share one size), at `area` pixels (the pipeline's own `image_processor.resize`)."""
        pil = crop_to_aspect(decode_rgb(image), self.height, self.width)
        w, h = edit_size(pil.width, pil.height, area)
        return self.pipe.image_processor.resize(pil, h, w)

    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[bytes] | None = None) -> QwenImageEditConditioning:
        require_sources(self, prompts, images)
        read = [self.source(im, self.vl_area) for im in images]
        encoded = read if self.vae_area == self.vl_area else [self.source(im, self.vae_area) for im in images]
        embeds, mask = self._encode_with_images(prompts, read)
        latents, grid = self._source_latents(encoded)
        return QwenImageEditConditioning(embeds, mask, latents, grid)

    def _encode_with_images(self, prompts: list[str], sources) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pipeline's `_get_qwen_prompt_embeds` with the processor's `mm_token_type_ids` passed on."""
        proc, enc = self.pipe.processor, self.pipe.text_encoder
        texts = [self.pipe.prompt_template_encode.format(self.image_prompt + p) for p in prompts]
        inputs = proc(text=texts, images=sources, padding=True, return_tensors="pt").to(self.device)
        hidden = enc(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                     pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                     mm_token_type_ids=inputs["mm_token_type_ids"], output_hidden_states=True).hidden_states[-1]
        drop = self.pipe.prompt_template_encode_start_idx
        rows = [h[m.bool()][drop:] for h, m in zip(hidden, inputs["attention_mask"])]
        longest = max(r.shape[0] for r in rows)
        embeds = torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], r.shape[1])]) for r in rows])
        mask = torch.stack([torch.arange(longest, device=self.device) < r.shape[0] for r in rows]).long()
        return embeds.to(self.dtype), (None if bool(mask.all()) else mask)

    def _source_latents(self, sources) -> tuple[torch.Tensor, tuple[int, int]]:
        """The sources' VAE latents at their mode, normalised and packed (`prepare_latents`)."""
        w, h = sources[0].size
        pixels = self.pipe.image_processor.preprocess(sources, h, w).unsqueeze(2)
        latents = self.pipe._encode_vae_image(pixels.to(self.device, self.vae.dtype), generator=None)
        b, c, _, lh, lw = latents.shape
        return self.pipe._pack_latents(latents, b, c, lh, lw), (lh // 2, lw // 2)

    # --- dynamics -------------------------------------------------------------------------------
    def _predict(self, packed, t, cond: QwenImageEditConditioning, img_shapes) -> torch.Tensor:
        n = packed.shape[1]
        shapes = [[*s, (1, *cond.source_grid)] for s in img_shapes]
        out = super()._predict(torch.cat([packed, cond.image_latents.to(packed.dtype)], dim=1), t, cond, shapes)
        return out[:, :n]

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0, **transformer) -> dict:
        """A random Qwen-Image-Edit-shaped pipeline (Qwen-Image's tiny parts; the Qwen2.5-VL text
        encoder with its vision tower, the vision tokens, and the edit template's words whole, so
        that its system part is the 64 tokens the pipeline drops, as with the real tokenizer; the
        Qwen2VLProcessor's files), with a tiny editing prompt set beside it (`edits/edits.jsonl`)."""
        import shutil

        from .flux_kontext import write_edit_prompts
        from .qwen_image_parts import save_edit_pipeline, tiny_edit_parts

        torch.manual_seed(seed)
        build = out_dir.parent / (out_dir.name + "_build")
        save_edit_pipeline(tiny_edit_parts(build, **transformer), out_dir, cls.pipeline_class)
        shutil.rmtree(build, ignore_errors=True)
        prompts = write_edit_prompts(out_dir / "edits", seed)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32,
                "model.max_sequence_length": 64, "dataset.name": "edits", "dataset.path": str(prompts),
                "dataset.heldout_path": "null", "dataset.categories": "null"}
