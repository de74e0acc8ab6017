"""Qwen-Image-2.1 (text-to-image), as QwenImage21Pipeline computes it: a single-stream DiT
(QwenImage21Transformer2DModel) whose joint sequence is the prompt's Qwen3-VL hidden states with
the target's latent tokens dropped into slots after them (each slot four tokens), an RGBA VAE
compressing 16× (AutoencoderKLQwenImage21; latents unpatched, one token per 16² pixels,
normalised by per-channel mean/std), and a flow-matching Euler schedule with the dynamic shift of
the latent sequence (the checkpoint's `sample_sigmas` where the step count matches them, else the
pipeline's linspace(1, 1/T, T)).

Prompt encoding is the pipeline's own `_get_qwen_prompt_embeds`: the raw chat template with its
system turn ("Comprehend and analyze the provided prompt."), left padding, the last decoder
layer's output before the final norm, the system tokens dropped; the whole prompt is read (the
pipeline has no length limit, so `model.max_sequence_length` only bounds nothing here). Guidance
is true CFG without a rescale: a negative-prompt pass and neg + s·(pos − neg). The transformer's
prefix KV cache (an inference speed-up for condition tokens that do not change across steps) is
not used: every step is one forward, as training needs. The decoder's alpha channel is
composited over white, as the pipeline composites a condition image for its vision encoder;
rewards read RGB.

Editing: given an editing set, each prompt's source image is its condition image, as the
pipeline takes `image` (one per prompt; a prompt set is all edits or all text-to-image). The
source, centre-cropped to the target's aspect and read at the target's area (the pipeline's
`output_resolution`² = height × width), is seen by Qwen3-VL in the edit template (its alpha
composited over white) and encoded by the VAE with its alpha (RGBA) into latent tokens that fill
the encoder's image slots; the negative prompt is read with each row's source too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .pipelines import PipelineFamily, dynamic_shift_mu, encodes_text, packed_grid, unit_range
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime

__all__ = ["QwenImage21Conditioning", "QwenImage21Family"]


@dataclass
class QwenImage21Conditioning:
    """Qwen3-VL hidden states of the prompts (system turn dropped), padding and image-slot masks."""

    prompt_embeds: torch.Tensor  # [B, L, D]
    mask: torch.Tensor | None  # [B, L]; None when no row is padded
    image_pad_mask: torch.Tensor  # [B, L] bool: the encoder's image slots (none for text-to-image)
    image_latents: torch.Tensor | None = None  # [B, L_src, C] an edit's source tokens, filling those slots
    source_grid: tuple[int, int] = (0, 0)  # the source's (h, w) in latent tokens: its img_shapes entry

    def select(self, idx) -> "QwenImage21Conditioning":
        return QwenImage21Conditioning(self.prompt_embeds[idx], None if self.mask is None else self.mask[idx],
                                       self.image_pad_mask[idx],
                                       None if self.image_latents is None else self.image_latents[idx],
                                       self.source_grid)

    def expand(self, n: int) -> "QwenImage21Conditioning":
        return QwenImage21Conditioning(self.prompt_embeds.expand(n, -1, -1),
                                       None if self.mask is None else self.mask.expand(n, -1),
                                       self.image_pad_mask.expand(n, -1),
                                       None if self.image_latents is None else self.image_latents.expand(n, -1, -1),
                                       self.source_grid)


@register_family("qwen_image21")
class QwenImage21Family(PipelineFamily):
    name = "qwen_image21"
    pipeline_class = "QwenImage21Pipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    guidance = "cfg"
    text_tokens = (1, 4096)  # not a limit the pipeline applies: it reads whole prompts
    lora_targets = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]
    takes_images = True  # a prompt may carry a source image: its condition image (an edit)
    negative_reads_images = True  # an edit's negative prompt is read with its source, as the pipeline reads it
    swap_at_construction = True  # its constructor reads the processor (the system turn's length)

    @staticmethod
    def swap_components(path: Path) -> dict:
        """The checkpoint's Qwen3VLProcessor, which transformers builds only with torchvision (its
        video processor): what it computes, from the same files (models/qwen_vl_processor.py)."""
        from .qwen_vl_processor import QwenVLProcessor

        return {"processor": lambda: QwenVLProcessor.from_pretrained(path / "processor")}

    @staticmethod
    def default_resolution(pipe) -> int:
        return 1024  # the pipeline's output_resolution

    @staticmethod
    def resolution_multiple(pipe) -> int:
        return pipe.vae_scale_factor * 2

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[bytes | None] | None = None) -> QwenImage21Conditioning:
        if images is None or all(im is None for im in images):
            embeds, mask, image_pad = self.pipe._get_qwen_prompt_embeds(list(prompts), None, self.device)
            return QwenImage21Conditioning(embeds.to(self.dtype), None if bool(mask.all()) else mask, image_pad)
        if any(im is None for im in images):
            from .source_images import SourceImageError

            raise SourceImageError("these prompts mix edits (with a source image) and text-to-image prompts; a "
                                   "Qwen-Image-2.1 prompt set is all one or the other")
        sources = [self.source(im) for im in images]
        rows = [self.pipe._get_qwen_prompt_embeds([p], [src], self.device) for p, src in zip(prompts, sources)]
        longest = max(e.shape[1] for e, _, _ in rows)
        pad = lambda t, v: torch.cat([t, t.new_full((1, longest - t.shape[1], *t.shape[2:]), v)], dim=1)  # noqa: E731
        embeds = torch.cat([pad(e, 0) for e, _, _ in rows])
        mask = torch.cat([pad(m, 0) for _, m, _ in rows])
        image_pad = torch.cat([pad(i, False) for _, _, i in rows])
        w, h = sources[0].size
        pixels = self.pipe.image_processor.preprocess(sources, height=h, width=w).unsqueeze(2)
        latents = self.pipe._encode_vae_image(pixels.to(self.device, self.vae.dtype), generator=None)
        b, c, _, lh, lw = latents.shape
        if int(image_pad[0].sum()) * 4 != lh * lw:
            from .source_images import SourceImageError

            raise SourceImageError(f"the checkpoint's image processor reads a {w}×{h} source as "
                                   f"{int(image_pad[0].sum())} image tokens, and its {lh}×{lw} latent grid needs "
                                   f"{lh * lw // 4}: its max_pixels (processor/preprocessor_config.json) is below "
                                   f"{w * h}; lower model.resolution or raise it")
        return QwenImage21Conditioning(embeds.to(self.dtype), None if bool(mask.all()) else mask, image_pad,
                                       self.pipe._pack_latents(latents, b, c, lh, lw), (lh, lw))

    def source(self, image: bytes):
        """An edit's source as the pipeline reads it: RGBA, centre-cropped to the target's aspect,
        at the target's area (`calculate_dimensions(output_resolution², aspect)`, the pipeline's own
        resize, with output_resolution² = height·width)."""
        from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

        from .source_images import crop_to_aspect, decode_rgb

        pil = crop_to_aspect(decode_rgb(image), self.height, self.width).convert("RGBA")
        w, h, _ = calculate_dimensions(self.height * self.width, pil.width / pil.height)
        return self.pipe.image_processor.resize(pil, height=int(h), width=int(w))

    # --- dynamics -----------------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int]:
        h, w = packed_grid(self.height, self.width, self.pipe.vae_scale_factor)
        return self.transformer.config.in_channels, h, w

    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(σ [T+1] ending at 0, timesteps [T]) as the pipeline sets them."""
        from copy import deepcopy

        _, h, w = self.latent_shape()
        given = self.pipe.config.get("sample_sigmas")
        sigmas = given if given is not None and len(given) == steps else np.linspace(1.0, 1 / steps, steps)
        sched = deepcopy(self.scheduler)
        sched.set_timesteps(sigmas=sigmas, device=self.device, mu=dynamic_shift_mu(sched, h * w))
        return sched.sigmas.float().clone(), sched.timesteps.float().clone()

    def _predict(self, packed: torch.Tensor, t: torch.Tensor, cond: QwenImage21Conditioning, h: int,
                 w: int) -> torch.Tensor:
        """The transformer's output for each row as for that row alone. The target's tokens follow
        the prompt's in one sequence, so a padded row would place them — and their rotary
        positions — after its padding: rows are run in groups of one prompt length, unpadded."""
        b = packed.shape[0]
        if cond.prompt_embeds.shape[0] != b:  # one encoding for the batch (the negative prompt's)
            cond = cond.expand(b)
        if cond.mask is None:
            return self._forward(packed, t, cond, h, w)
        lengths = cond.mask.sum(1)
        out = None
        for n in lengths.unique().tolist():
            rows = (lengths == n).nonzero(as_tuple=True)[0]
            part = cond.select(rows)
            part = QwenImage21Conditioning(part.prompt_embeds[:, :n], None, part.image_pad_mask[:, :n],
                                           part.image_latents, part.source_grid)
            got = self._forward(packed[rows], t[rows], part, h, w)
            out = got.new_empty(b, *got.shape[1:]) if out is None else out
            out[rows] = got
        return out

    def _forward(self, packed: torch.Tensor, t: torch.Tensor, cond: QwenImage21Conditioning, h: int,
                 w: int) -> torch.Tensor:
        b = packed.shape[0]
        slots = cond.image_pad_mask.new_ones(b, h * w // 4)  # the target's slots after the prompt's
        shapes = [(1, h, w)]
        if cond.image_latents is not None:  # an edit: the source's tokens first, in the encoder's image slots
            packed = torch.cat([cond.image_latents.to(packed.dtype), packed], dim=1)
            shapes = [(1, *cond.source_grid), *shapes]
        return self.transformer(hidden_states=packed, timestep=t / 1000, encoder_hidden_states=cond.prompt_embeds,
                                encoder_hidden_states_mask=cond.mask, img_shapes=[shapes] * b,
                                img_mask=torch.cat([cond.image_pad_mask, slots], dim=1),
                                return_dict=False)[0][:, -h * w:]  # the target's tokens, last

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: QwenImage21Conditioning,
                 guidance_scale: float = 1.0, neg: QwenImage21Conditioning | None = None) -> torch.Tensor:
        """v_θ(x, t | c) on latents [B, C, H, W]; above scale 1 the pipeline's true CFG."""
        b, c, h, w = x.shape
        t = timestep.reshape(-1).to(x.device, x.dtype)
        t = t.expand(b) if t.numel() == 1 else t
        packed = x.reshape(b, c, h * w).transpose(1, 2)
        v = self._predict(packed, t, cond, h, w)
        if guidance_scale > 1.0:
            if neg is None:
                raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
            v_neg = self._predict(packed, t, neg, h, w)
            v = v_neg + guidance_scale * (v - v_neg)
        return v.transpose(1, 2).reshape(b, c, h, w)

    # --- pixels -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents → uint8 [B, H, W, 3]: de-normalised, one-frame decode, the RGBA output's
        alpha composited over white."""
        cfg = self.vae.config
        z = latents.to(self.vae.dtype).unsqueeze(2)
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        out = unit_range(self.vae.decode(z * std + mean, return_dict=False)[0][:, :, 0])
        rgb = out[:, :3] * out[:, 3:4] + (1 - out[:, 3:4]) if out.shape[1] == 4 else out
        return (rgb.permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random Qwen-Image-2.1-shaped pipeline (Qwen3-VL text encoder with its vision tower and
        the processor's files in `processor/`, the 16× RGBA VAE, the single-stream DiT) with tiny
        widths, in the released layout. Returns the overrides that run it (64 px: 4 × 4 tokens)."""
        import shutil

        from .qwen_image21_parts import save_pipeline, tiny_parts

        torch.manual_seed(seed)
        build = out_dir.parent / (out_dir.name + "_build")
        save_pipeline(tiny_parts(build), out_dir)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 64,
                "model.max_sequence_length": 64}
