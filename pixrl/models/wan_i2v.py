"""Wan2.1 / Wan2.2 image-to-video: a clip that starts from a given first frame
(diffusers WanImageToVideoPipeline). Text, schedule, experts, CFG and decode are the text-to-video
family's (models/wan.py); what image-to-video adds is conditioning, as the pipeline builds it:

- the first frame, followed by F−1 black frames, is VAE-encoded at its posterior mode and
  normalised by the latent mean/std; a mask marks its latent frame (ones over the first latent
  frame's ×T temporal slots, zeros after); the transformer reads [noisy latents; mask; frame
  latents] concatenated in channels (Wan2.1-I2V: 16 + 4 + 16 = 36);
- Wan2.1-I2V also reads the frame's CLIP ViT-H image embeddings (the penultimate hidden states)
  through its cross-attention's added key/value projections; Wan2.2-I2V-A14B has no image encoder
  (and two experts, as T2V-A14B: `model.expert`).

The condition is fixed by the prompt's source image (docs/editing.md: prompt sets whose rows carry
an `image`), so the sampler's state is the pipeline's latents and every flow kernel and
algorithm applies unchanged; the unconditional CFG pass keeps the image condition and swaps only
the text, as the pipeline's does. The source is resized to the clip's size (aspect
kept, centre-cropped), and that same picture is what the VAE and the CLIP encoder read (the
pipeline gives CLIP the image as passed; for a source of that size the two agree).

Wan2.2-TI2V-5B's image-to-video (`expand_timesteps`: the first latent frame held clean, its tokens
at timestep 0) is family `wan_ti2v` (models/wan_ti2v.py). Not supported: first-last-frame (FLF2V).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .base import ModelLoadError
from .pipelines import encodes_text
from .registry import register_family
from .source_images import SourceImageError, require_sources, source_pixels, write_prompt_images
from .wan import WanConditioning, WanFamily, tiny_wan_parts, tiny_wan_transformer

__all__ = ["WanI2VConditioning", "WanI2VFamily"]


@dataclass
class WanI2VConditioning(WanConditioning):
    """The prompts' UMT5 states plus each prompt's first frame: the channel condition and, for
    Wan2.1, its CLIP image embeddings (None for the negative prompt, which borrows the rows' own)."""

    condition: torch.Tensor | None = None  # [B, T + C, F', H', W']: first-frame mask, then its latents
    image_embeds: torch.Tensor | None = None  # [B, 257, 1280] (Wan2.1-I2V) or None (Wan2.2-I2V)

    def select(self, idx) -> "WanI2VConditioning":
        return WanI2VConditioning(self.prompt_embeds[idx], *(None if v is None else v[idx]
                                                             for v in (self.condition, self.image_embeds)))

    def expand(self, n: int) -> "WanI2VConditioning":
        grow = (lambda v: None if v is None else v.expand(n, *v.shape[1:]))  # noqa: E731
        return WanI2VConditioning(grow(self.prompt_embeds), grow(self.condition), grow(self.image_embeds))

    def with_text(self, text: WanConditioning) -> "WanI2VConditioning":
        """These rows' image condition under other prompts (CFG's unconditional pass)."""
        return WanI2VConditioning(text.prompt_embeds, self.condition, self.image_embeds)


@register_family("wan_i2v")
class WanI2VFamily(WanFamily):
    name = "wan_i2v"
    pipeline_class = "WanImageToVideoPipeline"
    takes_images = True  # encode_prompts(prompts, images): each prompt's first frame
    needs_images = True  # image-to-video: every prompt has one
    image_use = "animates a first frame"  # what it does with them (errors say it)
    conditioning_towers = ("text_encoder", "image_encoder")
    # flow_grpo's Wan targets: the attention projections, and the image cross-attention's added
    # key/value projections where the transformer has them (Wan2.1-I2V)
    lora_targets = [*WanFamily.lora_targets, "add_k_proj", "add_v_proj"]

    def __init__(self, pipe, *args, **kwargs):
        if pipe.config.expand_timesteps:
            raise ModelLoadError("this checkpoint is Wan2.2-TI2V-5B's image-to-video (expand_timesteps: the first latent "
                                 "frame held clean at timestep 0): train it with model.family=wan_ti2v (its "
                                 "text-to-video: model.family=wan)")
        super().__init__(pipe, *args, **kwargs)
        if self.transformer.config.pos_embed_seq_len is not None:
            raise ModelLoadError(f"{self.path!r} is a first-last-frame checkpoint (Wan2.1-FLF2V: its image embedder reads "
                                 "two frames' CLIP states), which the wan_i2v family does not condition; use an "
                                 "image-to-video checkpoint (Wan2.1-I2V, Wan2.2-I2V-A14B)")
        vae, t = pipe.vae.config, pipe.vae_scale_factor_temporal
        want = 2 * vae.z_dim + t
        if self.transformer.config.in_channels != want:
            raise ModelLoadError(f"{self.path!r}: its transformer reads {self.transformer.config.in_channels} channels; "
                                 f"image-to-video reads {want} (latents {vae.z_dim} + first-frame mask {t} + first-frame "
                                 f"latents {vae.z_dim}) — is it a text-to-video checkpoint? (model.family=wan)")
        self.reads_clip = self.transformer.config.image_dim is not None
        # (a trainer rank reads neither tower: text_towers=False leaves both out on purpose)
        if self.reads_clip and pipe.image_encoder is None and pipe.text_encoder is not None:
            raise ModelLoadError(f"{self.path!r}: its transformer reads CLIP image embeddings (image_dim) but the "
                                 "checkpoint has no image_encoder; restore image_encoder/ and image_processor/")

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[bytes] | None = None) -> WanI2VConditioning:
        """The prompts' text states; with `images` (one per prompt), each prompt's first-frame
        condition. Without images: text alone, as the negative prompt is encoded."""
        text = self.encode_text(prompts)
        if images is None:
            return WanI2VConditioning(text.prompt_embeds)
        require_sources(self, prompts, images)
        frames = [self._first_frame(im) for im in images]
        condition = torch.cat([c for c, _ in frames])
        embeds = torch.cat([e for _, e in frames]) if self.reads_clip else None
        return WanI2VConditioning(text.prompt_embeds, condition, embeds)

    def _first_frame(self, image: bytes) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([1, T + C, F', H', W'] mask and latents, [1, N, D] CLIP states or None) of one source
        image, from WanImageToVideoPipeline's own `prepare_latents` (given zero noise, which it
        returns untouched) and `encode_image`."""
        picture, pixels = source_pixels(self, image, torch.float32)
        noise = torch.zeros(1, *self.latent_shape(), device=self.device)
        _, condition = self.pipe.prepare_latents(pixels, 1, noise.shape[1], self.height, self.width, self.frames, torch.float32,
                                                 self.device, None, noise)
        embeds = self.pipe.encode_image(picture, self.device) if self.reads_clip else None
        return condition, embeds

    # --- dynamics -----------------------------------------------------------------------------
    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: WanI2VConditioning,
                 guidance_scale: float = 1.0, neg: WanConditioning | None = None) -> torch.Tensor:
        """v_θ on video latents [B, C, F', H', W'] given each row's first frame; CFG's
        unconditional pass keeps the rows' image condition under the negative prompt."""
        if cond.condition is None:
            raise SourceImageError(f"the {self.name} family animates a first frame: these prompts were encoded without "
                                   "source images")
        return super().velocity(x, timestep, cond, guidance_scale, None if neg is None else cond.with_text(neg))

    def _predict(self, module, x, t, cond: WanI2VConditioning) -> torch.Tensor:
        dtype = module.dtype
        image = None if cond.image_embeds is None else cond.image_embeds.to(dtype)
        hidden = torch.cat([x, cond.condition.to(x.dtype)], dim=1).to(dtype)
        return module(hidden_states=hidden, timestep=t, encoder_hidden_states=cond.prompt_embeds.to(dtype),
                      encoder_hidden_states_image=image, return_dict=False)[0]

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0, two_experts: bool = False) -> dict:
        """A random Wan2.1-I2V-shaped pipeline: Wan's tiny parts (models/wan.py), a transformer
        reading latents + mask + first-frame latents (4 + 2 + 4 channels) and CLIP image states
        (a tiny CLIPVisionModel with its CLIPImageProcessor), and a small prompt set of first
        frames beside it (`first_frames/prompts.jsonl`). `two_experts`: Wan2.2-I2V-A14B's layout —
        no image encoder, two transformers switched at boundary_ratio 0.9 (the high-noise one trained)."""
        import shutil

        from diffusers import WanImageToVideoPipeline
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

        build = out_dir.parent / (out_dir.name + "_build")
        parts = tiny_wan_parts(build, seed)
        z, t = parts["vae"].config.z_dim, parts["vae"].config.scale_factor_temporal
        if two_experts:
            high = tiny_wan_transformer(2 * z + t, z)
            torch.manual_seed(seed + 1)
            extra = dict(transformer=high, transformer_2=tiny_wan_transformer(2 * z + t, z), boundary_ratio=0.9)
        else:
            clip = CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                                    num_attention_heads=2, image_size=32, patch_size=8))
            processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
            extra = dict(image_encoder=clip, image_processor=processor,
                         transformer=tiny_wan_transformer(2 * z + t, z, image_dim=32, added_kv_proj_dim=16))
        WanImageToVideoPipeline(**parts, **extra).save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        prompts = write_prompt_images(out_dir / "first_frames", FIRST_FRAME_PROMPTS, seed, stem="frame")
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32, "model.frames": 5,
                "model.max_sequence_length": 64, "dataset.name": "edits", "dataset.path": str(prompts),
                "dataset.heldout_path": "null", "dataset.categories": "null",
                # the high-noise expert trains; the SDE window on its steps (t ≥ 900)
                **({"model.expert": "high", "sampling.window_size": 2, "sampling.window_range": "[0,2]"}
                   if two_experts else {})}


FIRST_FRAME_PROMPTS = ["the red circle drifts to the right", "the square slowly turns blue",
                       "the camera zooms in", "the shapes fade into fog"]
