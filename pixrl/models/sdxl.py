"""Stable Diffusion XL family: diffusers StableDiffusionXLPipeline — a UNet with SDXL's micro-
conditioning (pooled text embedding and size/crop time ids), two CLIP text encoders, a DDPM
schedule. Diffusion-DPO's flagship model (DPO-SDXL, algorithms.md §9).

Everything about the variance-preserving process is the sd15 family's (`SD15Family`): the DDIM
grid as flow noise levels, the flow velocity of the UNet's ε or v, DDPO's DDIM-η step, the DDPM
timesteps and ε error of DPO. What is SDXL's own: prompts encoded by both towers as the pipeline
does (penultimate hidden states concatenated, the second tower's pooled projection), and the
UNet's added conditioning — the pooled embedding and the time ids (original size, crop corner
(0, 0), target size: the generated image's side, as the pipeline sets them by default).

The empty prompt is the negative prompt: with the checkpoint's `force_zeros_for_empty_prompt`
(SDXL base sets it) its embeddings are zeros, as the pipeline makes them when no negative prompt
is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .pipelines import encodes_text
from .registry import register_family
from .sd15 import SD15Family

__all__ = ["SDXLConditioning", "SDXLFamily"]


@dataclass
class SDXLConditioning:
    """Both towers' per-token embeddings [B, 77, D1 + D2] and the second tower's pooled projection."""

    prompt_embeds: torch.Tensor
    pooled: torch.Tensor

    def select(self, idx) -> "SDXLConditioning":
        return SDXLConditioning(self.prompt_embeds[idx], self.pooled[idx])

    def expand(self, n: int) -> "SDXLConditioning":
        return SDXLConditioning(self.prompt_embeds.expand(n, -1, -1), self.pooled.expand(n, -1))


@register_family("sdxl")
class SDXLFamily(SD15Family):
    """A loaded StableDiffusionXLPipeline checkpoint (SDXL base 1.0 and its fine-tunes)."""

    name = "sdxl"
    pipeline_class = "StableDiffusionXLPipeline"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ids: dict[tuple, torch.Tensor] = {}

    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> SDXLConditioning:
        embeds, _, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, device=self.device,
                                                       num_images_per_prompt=1, do_classifier_free_guidance=False)
        if self.pipe.config.get("force_zeros_for_empty_prompt", False):
            empty = torch.tensor([p == "" for p in prompts], device=embeds.device)
            embeds = torch.where(empty[:, None, None], torch.zeros_like(embeds), embeds)
            pooled = torch.where(empty[:, None], torch.zeros_like(pooled), pooled)
        return SDXLConditioning(embeds, pooled)

    def _time_ids(self, rows: int, device, dtype) -> torch.Tensor:
        """The pipeline's time ids of the image size (original = target = (height, width), no
        crop), made once per (size, device, dtype)."""
        size = (self.height, self.width)
        key = (size, str(device), dtype)
        if key not in self._ids:
            self._ids[key] = self.pipe._get_add_time_ids(size, (0, 0), size, dtype=dtype,
                                                         text_encoder_projection_dim=self._projection_dim()).to(device)
        return self._ids[key].repeat(rows, 1)

    def _projection_dim(self) -> int:
        tower = self.pipe.text_encoder_2
        if tower is not None:
            return int(tower.config.projection_dim)
        # loaded without text towers (a trainer rank): the UNet's added-embedding width tells it
        cfg = self.transformer.config
        return int(cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim)

    def unet_output(self, x_t: torch.Tensor, t: torch.Tensor, *conds: SDXLConditioning) -> torch.Tensor:
        embeds = torch.cat([c.prompt_embeds for c in conds])
        pooled = torch.cat([c.pooled for c in conds])
        added = {"text_embeds": pooled, "time_ids": self._time_ids(len(x_t), x_t.device, embeds.dtype)}
        return self.transformer(x_t, t, encoder_hidden_states=embeds, added_cond_kwargs=added,
                                return_dict=False)[0].float()

    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random SDXL-shaped pipeline (a UNet with text-time added conditioning and linear
        projections, CLIP + CLIP-with-projection towers, SDXL's Euler scheduler config) with tiny
        widths, saved with `save_pretrained`."""
        import shutil

        from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

        from .tiny_parts import clip_text_model, clip_tokenizer

        torch.manual_seed(seed)
        build = out_dir.parent / (out_dir.name + "_build")
        tok, tok2 = clip_tokenizer(build / "tokenizer"), clip_tokenizer(build / "tokenizer_2")
        text, text2 = clip_text_model(tok), clip_text_model(tok2, with_projection=True)
        unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                    block_out_channels=(16, 32), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=64,
                                    attention_head_dim=(2, 4), norm_num_groups=8, use_linear_projection=True,
                                    addition_embed_type="text_time", addition_time_embed_dim=8,
                                    projection_class_embeddings_input_dim=8 * 6 + 32)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                            latent_channels=4, norm_num_groups=8, scaling_factor=0.13025, force_upcast=True)
        sched = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       steps_offset=1, timestep_spacing="leading")
        sched.register_to_config(set_alpha_to_one=False, clip_sample=False)  # as SDXL base's config lists them
        pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=text, text_encoder_2=text2, tokenizer=tok,
                                         tokenizer_2=tok2, unet=unet, scheduler=sched, force_zeros_for_empty_prompt=True,
                                         add_watermarker=False)
        pipe.save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 16}
