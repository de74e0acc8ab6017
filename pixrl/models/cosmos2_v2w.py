"""Cosmos-Predict2 Video2World given one image (2B and 14B; diffusers Cosmos2VideoToWorldPipeline
with `image=`): the clip that follows each prompt's source image. Text, EDM grid as a flow, CFG,
the zero-length last step and the guardrail are the `cosmos2` family's; what Video2World adds, as
the pipeline computes it:

- the source is resized to the clip's size and VAE-encoded (the Wan VAE is causal: its first
  latent frame is the image's alone, whatever frames the pipeline pads after it), normalised by the
  latent mean/std times σ_data: the clean first latent frame c;
- the transformer reads c there (its time t(σ_conditioning = 1e-4), a condition-mask channel of
  ones on that frame, zeros elsewhere; `fps`, 16 by default, sets its rotary time) and the
  pipeline replaces its data prediction there by c (`model.frame_rate` is its `fps`). On the flow that is the velocity (x − c)/t
  towards c (models/held_frame.py): that part of every transition holds no policy parameter;
- the pipeline leaves that frame as its EDM step leaves it (c + σ_min·ε̂ at the end), and so does
  pixrl (no overwrite).

Deviation: the pipeline samples c from the VAE's posterior with each sample's generator (before
drawing its noise); pixrl takes the posterior's mode, so a prompt's condition is one tensor
whatever the seed (it is encoded once, with the prompt). Given the same condition and noise the
ODE equals the pipeline's. Sources are resized to the clip's size (aspect kept, centre-cropped).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .base import ModelLoadError
from .cosmos2 import Cosmos2Conditioning, Cosmos2Family, decode_clips, first_latent_frame, prompt_conditioning
from .held_frame import held_input, held_velocity
from .pipelines import encodes_text
from .registry import register_family
from .source_images import write_prompt_images

__all__ = ["Cosmos2Video2WorldFamily"]

SIGMA_CONDITIONING = 0.0001  # the pipeline's `sigma_conditioning`: the condition frame's noise level


@register_family("cosmos2_v2w")
class Cosmos2Video2WorldFamily(Cosmos2Family):
    name = "cosmos2_v2w"
    pipeline_class = "Cosmos2VideoToWorldPipeline"
    video = True
    takes_images = True  # encode_prompts(prompts, images): each prompt's first frame
    needs_images = True
    image_use = "animates a first frame"
    default_frames = 93  # the pipeline's num_frames
    decode_batch = 2  # clips per VAE decode
    options = {"frame_rate": "the clip's frames per second the transformer's rotary time reads (the pipeline's fps, 16)"}

    def __init__(self, pipe, *args, frame_rate: float | None = None, **kwargs):
        super().__init__(pipe, *args, **kwargs)
        self.fps = 16 if frame_rate is None else frame_rate
        if self.fps <= 0:
            raise ModelLoadError(f"model.frame_rate={frame_rate}: a frame rate is a positive number of frames per "
                                 "second")
        self.set_clip_frames()

    @staticmethod
    def default_resolution(pipe) -> tuple[int, int]:
        return 704, 1280  # the pipeline's default clip

    def describe(self) -> dict:
        return {**super().describe(), "frames": self.frames, "fps": self.fps,
                "sigma_conditioning": SIGMA_CONDITIONING}

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[bytes] | None = None) -> Cosmos2Conditioning:
        """The prompts' T5 states; with `images` (one per prompt), each prompt's first latent frame.
        Without images: text alone, as the negative prompt is encoded."""
        return prompt_conditioning(self, prompts, images)

    def first_frame(self, image: bytes) -> torch.Tensor:
        """[1, C, 1, H', W']: the source as the pipeline's video processor reads it, encoded as a
        one-frame clip (posterior mode), normalised (with σ_data) as its `prepare_latents`."""
        return first_latent_frame(self, image, self.scheduler.config.sigma_data)

    # --- dynamics -----------------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int, int]:
        h, w = self.latent_grid(self.pipe.vae_scale_factor_spatial)
        return self.vae.config.z_dim, (self.frames - 1) // self.pipe.vae_scale_factor_temporal + 1, h, w

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: Cosmos2Conditioning,
                 guidance_scale: float = 1.0, neg: Cosmos2Conditioning | None = None) -> torch.Tensor:
        """v on clip latents [B, C, F', H', W']: the transformer's (with the pipeline's CFG, w = s − 1)
        on every latent frame but the first, whose velocity is the one towards its condition."""
        from .source_images import SourceImageError

        if cond.condition is None:
            raise SourceImageError(f"the {self.name} family animates a first frame: these prompts were encoded "
                                   "without source images")
        b, _, f, h, w = x.shape
        t = timestep.reshape(-1).to(x.device)
        t = t.expand(b) if t.numel() == 1 else t
        dtype = self.transformer.dtype
        s_c = torch.tensor(SIGMA_CONDITIONING, dtype=torch.float32, device=x.device)
        times = t.float().view(b, 1, 1, 1, 1).expand(b, 1, f, 1, 1).clone()
        times[:, :, :1] = s_c / (s_c + 1)  # the pipeline's t_conditioning on the condition frame
        mask = torch.zeros(b, 1, f, h, w, dtype=dtype, device=x.device)
        mask[:, :, :1] = 1
        hidden = held_input(x, cond.condition)
        v = self._predict_frames(hidden, times, cond, mask)
        if guidance_scale > 1.0:
            if neg is None:
                raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
            v_u = self._predict_frames(hidden, times, neg, mask)
            v = v + (guidance_scale - 1.0) * (v - v_u)
        return held_velocity(x, cond.condition, v, t)

    def _predict_frames(self, x: torch.Tensor, times: torch.Tensor, cond: Cosmos2Conditioning,
                        mask: torch.Tensor) -> torch.Tensor:
        dtype = self.transformer.dtype
        pad = x.new_zeros(1, 1, self.height, self.width, dtype=dtype)
        return self.transformer(hidden_states=x.to(dtype), timestep=times.to(dtype),
                                encoder_hidden_states=cond.prompt_embeds.to(dtype), fps=self.fps, condition_mask=mask,
                                padding_mask=pad, return_dict=False)[0].float()

    # --- pixels -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [B, C, F', H', W'] → uint8 clips [B, F, H, W, 3]."""
        return decode_clips(self.vae, latents, self.scheduler.config.sigma_data)

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random Cosmos-Predict2-Video2World-shaped checkpoint (the `cosmos2` tiny parts with the
        transformer reading the condition-mask channel, RoPE scale (1, 3, 3) as the 2B Video2World)
        and a small prompt set of first frames beside it (`first_frames/prompts.jsonl`)."""
        import shutil

        from diffusers import CosmosTransformer3DModel

        from .cosmos2 import cosmos2_pipeline, cosmos2_scheduler
        from .tiny_parts import t5_encoder
        from .wan import tiny_wan_parts
        from .wan_i2v import FIRST_FRAME_PROMPTS

        build = out_dir.parent / (out_dir.name + "_build")
        parts = tiny_wan_parts(build, seed)
        parts["text_encoder"] = t5_encoder(parts["tokenizer"])
        z = parts["vae"].config.z_dim
        transformer = CosmosTransformer3DModel(
            in_channels=z + 1, out_channels=z, num_attention_heads=2, attention_head_dim=16, num_layers=1,
            mlp_ratio=2.0, text_embed_dim=32, adaln_lora_dim=8, max_size=(8, 32, 32), patch_size=(1, 2, 2),
            rope_scale=(1.0, 3.0, 3.0), concat_padding_mask=True, extra_pos_embed_type=None)
        pipe = cosmos2_pipeline(cls.pipeline_class, **{**parts, "scheduler": cosmos2_scheduler()},
                                transformer=transformer)
        pipe.save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        prompts = write_prompt_images(out_dir / "first_frames", FIRST_FRAME_PROMPTS, seed, stem="frame")
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32, "model.frames": 5,
                "model.max_sequence_length": 64, "dataset.name": "edits", "dataset.path": str(prompts),
                "dataset.heldout_path": "null", "dataset.categories": "null"}
