"""Wan2.2-TI2V-5B image-to-video: the text-to-video checkpoint (WanPipeline layout, a timestep per
latent token: `expand_timesteps`) animating each prompt's source image, as diffusers'
WanImageToVideoPipeline runs it. Text, schedule, CFG and decode are the `wan` family's; what
image-to-video adds, as the pipeline builds it:

- the source is VAE-encoded alone (a one-frame clip, posterior mode, normalised by the latent
  mean/std): the clean latents of the clip's first latent frame;
- at every step the transformer reads the noisy latents with their first latent frame replaced by
  that condition, and its tokens at timestep 0 (the others at the step's t); after the last step
  the pipeline overwrites the first frame with the condition.

The sampler's state keeps the pipeline's latents; the first latent frame's velocity is the exact
one towards the condition (models/held_frame.py), so Euler lands on it as the pipeline's overwrite
does, and that part of every transition holds no policy parameter. The ODE's final latents equal
the pipeline's. The unconditional CFG pass keeps the condition, as the pipeline's does. Sources
are resized to the clip's size (aspect kept, centre-cropped). Select it with
model.family=wan_ti2v on a Wan2.2-TI2V-5B checkout; its text-to-video is family `wan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .base import ModelLoadError
from .held_frame import held_final, held_input, held_timesteps, held_velocity
from .pipelines import encodes_text
from .registry import register_family
from .source_images import require_sources, source_pixels, write_prompt_images
from .wan import WanConditioning, WanFamily

__all__ = ["WanTI2VConditioning", "WanTI2VFamily"]


@dataclass
class WanTI2VConditioning(WanConditioning):
    """The prompts' UMT5 states plus each prompt's first-frame latents (None for the negative
    prompt, which borrows the rows' own)."""

    condition: torch.Tensor | None = None  # [B, C, 1, H', W']: the source's normalised latents

    def select(self, idx) -> "WanTI2VConditioning":
        return WanTI2VConditioning(self.prompt_embeds[idx], None if self.condition is None else self.condition[idx])

    def expand(self, n: int) -> "WanTI2VConditioning":
        grow = (lambda v: None if v is None else v.expand(n, *v.shape[1:]))  # noqa: E731
        return WanTI2VConditioning(grow(self.prompt_embeds), grow(self.condition))


@register_family("wan_ti2v")
class WanTI2VFamily(WanFamily):
    name = "wan_ti2v"
    takes_images = True  # encode_prompts(prompts, images): each prompt's first frame
    needs_images = True  # image-to-video: every prompt has one
    image_use = "animates a first frame"  # what it does with them (errors say it)
    options = {}  # one transformer: no expert to choose

    def __init__(self, pipe, *args, **kwargs):
        if not pipe.config.get("expand_timesteps", False):
            raise ModelLoadError("model.family=wan_ti2v animates a first frame with Wan2.2-TI2V-5B (expand_timesteps: a "
                                 "timestep per latent token); this checkpoint has none — its text-to-video is "
                                 "model.family=wan, and Wan2.1-I2V / Wan2.2-I2V-A14B checkpoints are model.family=wan_i2v")
        super().__init__(pipe, *args, **kwargs)
        from diffusers import WanImageToVideoPipeline

        self._prepare = WanImageToVideoPipeline.prepare_latents  # the pipeline's own first-frame encoding

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[bytes] | None = None) -> WanTI2VConditioning:
        """The prompts' text states; with `images` (one per prompt), each prompt's first-frame
        latents. Without images: text alone, as the negative prompt is encoded."""
        text = self.encode_text(prompts)
        if images is None:
            return WanTI2VConditioning(text.prompt_embeds)
        require_sources(self, prompts, images)
        return WanTI2VConditioning(text.prompt_embeds, torch.cat([self._first_frame(im) for im in images]))

    def _first_frame(self, image: bytes) -> torch.Tensor:
        """[1, C, 1, H', W'] of one source image, from WanImageToVideoPipeline's `prepare_latents`
        (given zero noise, which it returns untouched) on this checkpoint's VAE."""
        _, pixels = source_pixels(self, image, torch.float32)
        noise = torch.zeros(1, *self.latent_shape(), device=self.device)
        _, condition, _ = self._prepare(self.pipe, pixels, 1, noise.shape[1], self.height, self.width, self.frames,
                                        torch.float32, self.device, None, noise)
        return condition

    # --- dynamics -----------------------------------------------------------------------------
    #: the sampler's last act: the first latent frame set to the condition, as the pipeline ends
    final_latents = staticmethod(held_final)

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: WanTI2VConditioning,
                 guidance_scale: float = 1.0, neg: WanConditioning | None = None) -> torch.Tensor:
        """v on video latents [B, C, F', H', W']: the transformer's (with the pipeline's CFG) on
        every latent frame but the first, whose velocity is (x − c)/σ towards its condition c."""
        _, _, _, h, w = x.shape
        _, ph, pw = self.transformer.config.patch_size
        t, t_tokens = held_timesteps(self, x, timestep, cond, guidance_scale, neg, (h // ph) * (w // pw))
        hidden = held_input(x, cond.condition)
        v = self._predict(self.transformer, hidden, t_tokens, cond)
        if guidance_scale > 1.0:
            v_u = self._predict(self.transformer, hidden, t_tokens, WanConditioning(neg.prompt_embeds))
            v = v_u + guidance_scale * (v - v_u)
        return held_velocity(x, cond.condition, v, t / self.scheduler.config.num_train_timesteps)

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random Wan2.2-TI2V-5B-shaped checkpoint (`tiny_ti2v_pipeline`) and a small prompt set
        of first frames beside it (`first_frames/prompts.jsonl`). Returns the overrides that run
        it (32 px, 5 frames: 3 × 4 × 4 latents)."""
        from .wan_i2v import FIRST_FRAME_PROMPTS

        tiny_ti2v_pipeline(out_dir.parent / (out_dir.name + "_build"), seed).save_pretrained(str(out_dir),
                                                                                         safe_serialization=True)
        prompts = write_prompt_images(out_dir / "first_frames", FIRST_FRAME_PROMPTS, seed, stem="frame")
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32, "model.frames": 5,
                "model.max_sequence_length": 64, "dataset.name": "edits", "dataset.path": str(prompts),
                "dataset.heldout_path": "null", "dataset.categories": "null"}


def tiny_ti2v_pipeline(build: Path, seed: int):
    """A seeded tiny Wan2.2-TI2V-5B-shaped WanPipeline: `expand_timesteps` (a timestep per latent
    token), the residual, 2×2-patchified VAE of the 5B model (×8 in space here, ×16 in the real
    one; ×2 in time here, ×4 there), Wan's tiny text parts and a 1-block transformer, UniPC with
    flow shift 5 (the 5B's)."""
    import shutil

    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    from .wan import tiny_wan_parts, tiny_wan_transformer

    parts = tiny_wan_parts(build, seed)
    z = 4
    vae = AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=z, dim_mult=[1, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, True], is_residual=True, patch_size=2, in_channels=12,
                           out_channels=12, latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 2.0, 1.2, 1.8],
                           scale_factor_temporal=2, scale_factor_spatial=8)
    pipe = WanPipeline(tokenizer=parts["tokenizer"], text_encoder=parts["text_encoder"], vae=vae,
                       transformer=tiny_wan_transformer(z, z),
                       scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                         flow_shift=5.0), expand_timesteps=True)
    shutil.rmtree(build, ignore_errors=True)
    return pipe
