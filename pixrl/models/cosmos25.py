"""Cosmos-Predict2.5 (NVIDIA, 2B and 14B; diffusers Cosmos2_5_PredictBasePipeline): world clips
from text (Text2World) or from text and a first frame (Image2World, when the prompt set gives
images). A rectified flow — unlike Predict2's EDM — with the Cosmos DiT (condition-mask and
padding-mask channels, 3-D RoPE) on the Wan2.1 VAE's latents [C, (F−1)/4 + 1, H/8, W/8]. visual-rl
trains Cosmos-Predict2/2.5.

What is the family's own, as the pipeline computes it:
- the text: Cosmos-Reason1 (a Qwen2.5-VL) reads the prompt under a system turn ("You are a helpful
  assistant who will provide prompts to an image generator."), padded to `max_sequence_length`;
  every layer's hidden states are normalised (zero mean, unit std per token) and concatenated —
  28 × 3584 values per token for the 7B — which the transformer projects (`crossattn_proj`);
- the transformer's time is σ itself, per latent frame ([B, 1, F', 1, 1]); its output is the
  velocity; CFG is `cond + w·(cond − uncond)`, so pixrl's s is the pipeline's w + 1 (its 7 is 8);
- Image2World: the first frame's latents (posterior mode, normalised) held as the clip's clean
  first latent frame, read with a condition mask of ones there and time 1e-4
  (`conditional_frame_timestep`); the pipeline's velocity there is the straight line from the
  initial noise to the condition, which on the flow is (x − c)/σ (models/held_frame.py): equal
  along every deterministic path, parameter-free in every transition. The pipeline reads an
  image with torchvision (not installed here); pixrl reads it as its other image-to-video
  families do (resized, centre-cropped to the clip's aspect);
- the solver: the checkpoint ships UniPC on flow sigmas; rollouts step its σ grid with the shared
  Euler/SDE kernels, and the ODE equals the pipeline's given FlowMatchEulerDiscreteScheduler on
  that shift;
- Cosmos Guardrail (Qwen3Guard and video filters in the pipeline's `safety_checker`) is not run,
  as for `cosmos2`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .cosmos2 import (Cosmos2Conditioning, decode_clips, first_latent_frame, padding_mask_resize, prompt_conditioning,
                      without_guardrail)
from .held_frame import held_input, held_velocity
from .pipelines import PipelineFamily, encodes_text, scheduler_grid
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime

__all__ = ["Cosmos25Family"]

CONDITIONAL_FRAME_TIMESTEP = 0.0001  # the pipeline's `conditional_frame_timestep`


@register_family("cosmos25")
class Cosmos25Family(PipelineFamily):
    name = "cosmos25"
    pipeline_class = "Cosmos2_5_PredictBasePipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    guidance = "cfg"
    video = True
    takes_images = True  # encode_prompts(prompts, images): Image2World; without images, Text2World
    image_use = "animates a first frame"
    text_tokens = (1, 512)
    # attention and MLP of every block, as cosmos2's (cosmos-predict2.5's LoRA post-training targets)
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
    default_frames = 93  # the pipeline's num_frames
    decode_batch = 2
    unread_components = ("safety_checker",)

    def __init__(self, pipe, *args, **kwargs):
        padding_mask_resize()
        super().__init__(pipe, *args, **kwargs)
        self.set_clip_frames()

    @classmethod
    def pipeline_type(cls) -> type:
        return without_guardrail(cls.pipeline_class)

    @staticmethod
    def default_resolution(pipe) -> tuple[int, int]:
        return 704, 1280  # the pipeline's default clip

    @staticmethod
    def resolution_multiple(pipe) -> int:
        return pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size[1]

    def describe(self) -> dict:
        c = self.scheduler.config
        return {"resolution": [self.height, self.width], "frames": self.frames, "guidance": self.guidance,
                "shift": c.get("flow_shift", c.get("shift")), "scheduler": type(self.scheduler).__name__,
                "conditional_frame_timestep": CONDITIONAL_FRAME_TIMESTEP}

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[bytes] | None = None) -> Cosmos2Conditioning:
        """The pipeline's prompt states; with `images` (one per prompt) each prompt's first frame."""
        return prompt_conditioning(self, prompts, images)

    def first_frame(self, image: bytes) -> torch.Tensor:
        """[1, C, 1, H', W']: the source at the clip's size, encoded as a one-frame clip (posterior
        mode, as the pipeline's `prepare_latents`), normalised by the latent mean and std."""
        return first_latent_frame(self, image)

    # --- dynamics -----------------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int, int]:
        h, w = self.latent_grid(self.pipe.vae_scale_factor_spatial)
        return self.vae.config.z_dim, (self.frames - 1) // self.pipe.vae_scale_factor_temporal + 1, h, w

    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(σ [T+1] ending at 0, the transformer's times [T]: σ itself)."""
        sigmas, _ = scheduler_grid(self.scheduler, steps, self.device, self.name, self.path)
        return sigmas, sigmas[:-1].clone()

    def timesteps_at(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma.float()

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: Cosmos2Conditioning,
                 guidance_scale: float = 1.0, neg: Cosmos2Conditioning | None = None) -> torch.Tensor:
        """v on clip latents [B, C, F', H', W'] (with the pipeline's CFG, w = s − 1); Image2World:
        the first latent frame's is the one towards its condition."""
        b, _, f, h, w = x.shape
        t = timestep.reshape(-1).to(x.device)
        t = t.expand(b) if t.numel() == 1 else t
        dtype = self.transformer.dtype
        times = t.float().view(b, 1, 1, 1, 1).expand(b, 1, f, 1, 1).clone()
        mask = torch.zeros(b, 1, f, h, w, dtype=dtype, device=x.device)
        hidden = x
        if cond.condition is not None:
            times[:, :, :1] = CONDITIONAL_FRAME_TIMESTEP
            mask[:, :, :1] = 1
            hidden = held_input(x, cond.condition)
        v = self._predict(hidden, times, cond, mask)
        if guidance_scale > 1.0:
            if neg is None:
                raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
            v_u = self._predict(hidden, times, neg, mask)
            v = v + (guidance_scale - 1.0) * (v - v_u)
        return v if cond.condition is None else held_velocity(x, cond.condition, v, t)

    def _predict(self, x: torch.Tensor, times: torch.Tensor, cond: Cosmos2Conditioning,
                 mask: torch.Tensor) -> torch.Tensor:
        dtype = self.transformer.dtype
        pad = x.new_zeros(1, 1, self.height, self.width, dtype=dtype)
        return self.transformer(hidden_states=x.to(dtype), condition_mask=mask, timestep=times.to(dtype),
                                encoder_hidden_states=cond.prompt_embeds.to(dtype), padding_mask=pad,
                                return_dict=False)[0].float()

    # --- pixels -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [B, C, F', H', W'] → uint8 clips [B, F, H, W, 3]: the latent std and mean
        undone, decode (the causal VAE gives the clip's 4k + 1 frames)."""
        return decode_clips(self.vae, latents)

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random Cosmos-Predict2.5-shaped checkpoint: a one-block CosmosTransformer3DModel with
        the condition-mask channel and the cross-attention projection of the concatenated layer
        states, a two-layer Qwen2.5-VL text encoder under a Qwen2-VL chat template, the tiny Wan
        VAE, UniPC on flow sigmas; saved without a safety checker. Returns the overrides that run
        it (32 px, 5 frames, Text2World: the shapes prompt set)."""
        import shutil

        from diffusers import CosmosTransformer3DModel, UniPCMultistepScheduler

        from .cosmos2 import cosmos2_pipeline
        from .tiny_parts import QWEN_VL_CHAT_TEMPLATE, qwen2_tokenizer, qwen25_vl_text_encoder
        from .wan import tiny_wan_parts

        build = out_dir.parent / (out_dir.name + "_build")
        parts = tiny_wan_parts(build, seed)
        tok = qwen2_tokenizer(build / "qwen_tokenizer", extra_pieces=["Ġhelpful", "Ġassistant", "Ġprompts",
                                                                      "Ġgenerator", "Ġprovide"])
        tok.chat_template = QWEN_VL_CHAT_TEMPLATE
        layers, hidden = 2, 32
        text = qwen25_vl_text_encoder(tok, hidden=hidden, layers=layers)
        z = parts["vae"].config.z_dim
        transformer = CosmosTransformer3DModel(
            in_channels=z + 1, out_channels=z, num_attention_heads=2, attention_head_dim=16, num_layers=1,
            mlp_ratio=2.0, text_embed_dim=32, adaln_lora_dim=8, max_size=(8, 32, 32), patch_size=(1, 2, 2),
            rope_scale=(1.0, 3.0, 3.0), concat_padding_mask=True, extra_pos_embed_type=None,
            use_crossattn_projection=True, crossattn_proj_in_channels=layers * hidden,
            encoder_hidden_states_channels=32)
        sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0,
                                        num_train_timesteps=1000)
        pipe = cosmos2_pipeline(cls.pipeline_class, text_encoder=text, tokenizer=tok, transformer=transformer,
                                vae=parts["vae"], scheduler=sched)
        pipe.save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32, "model.frames": 5,
                "model.max_sequence_length": 64}
