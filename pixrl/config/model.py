"""The experiment config's `model` section: which checkpoint of which family, its size, and the
settings only some families read (`family_options`, handed to `Family.load`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from .sampling import _Section


class AudioVideoGuidance(_Section):
    """LTX-2's guidance terms beside CFG, per stream (models/ltx2.py); an unset one is the
    pipeline's default (an unset or zero audio setting takes the video one, as the pipeline's)."""

    audio_guidance_scale: float | None = Field(None, ge=1.0, description="CFG scale of the audio stream, applied "
                                               "whenever CFG runs (sampling.guidance_scale > 1); None: 7")
    guidance_rescale: float | None = Field(None, ge=0, le=1, description="x0 guidance rescale of the video stream; "
                                           "None: 0.7")
    audio_guidance_rescale: float | None = Field(None, ge=0, le=1, description="the audio stream's; None: 0.7")
    stg_scale: float | None = Field(None, ge=0, description="spatio-temporal guidance of the video stream (a pass "
                                    "with perturbed self-attention; 0: off); None: 1")
    audio_stg_scale: float | None = Field(None, ge=0, description="the audio stream's; None: 1")
    stg_blocks: list[int] | None = Field(None, description="the DiT blocks spatio-temporal guidance perturbs; "
                                         "None: [28]")
    modality_scale: float | None = Field(None, ge=1.0, description="modality-isolation guidance of the video stream "
                                         "(a pass without audio-video cross-attention; 1: off); None: 3")
    audio_modality_scale: float | None = Field(None, ge=1.0, description="the audio stream's; None: 3")


class ModelConfig(_Section):
    family: str = "sd3"
    path: str = "builtin:mini_shapes"  # local diffusers-layout dir, or builtin:<name> for embedded models
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: str = "cpu"
    max_sequence_length: int = Field(0, ge=0, description="T5 tokens (256 for SD3.5; 0 when there is no T5)")
    resolution: int | None = Field(None, ge=8, description="image side in pixels (a square); None: the checkpoint's "
                                   "default")
    height: int | None = Field(None, ge=8, description="image height in pixels, for non-square images and clips (Wan "
                               "480×832, CogVideoX 480×720); None: model.resolution")
    width: int | None = Field(None, ge=8, description="image width in pixels; None: model.resolution")
    frames: int | None = Field(None, ge=1, description="video families: frames per clip; None: the family's default")
    gradient_checkpointing: bool = Field(
        False, description="recompute each block's activations in the update's backward instead of keeping them "
        "(engines/activation_checkpointing.py): activation memory of one block instead of all, for about one more "
        "forward per update; losses and gradients unchanged")
    offload_text_encoders: bool = Field(
        False, description="keep the text encoders in host memory and bring them to model.device only to encode a "
        "prompt set (a prompt-cache miss: about twice an iteration): frees their weights' accelerator memory "
        "(T5-XXL 9.5 GB, Qwen2.5-VL 16 GB, Mistral-24B 48 GB in bf16); encodings unchanged. Diffusers families")
    expert: Literal["high", "low"] | None = Field(
        None, description="two-expert checkpoints (Wan2.2-A14B): the expert trained — 'high' denoises the steps at "
        "t ≥ boundary_ratio·T (the pipeline's `transformer`), 'low' the rest (`transformer_2`); the other samples "
        "frozen. Required for such a checkpoint, refused for any other")
    guidance_scale_2: float | None = Field(
        None, ge=1.0, description="two-expert checkpoints: the low-noise expert's CFG scale (the pipeline's "
        "guidance_scale_2; Wan2.2-T2V-A14B ships 3.0 beside 4.0); None: sampling.guidance_scale")
    cfg_normalization: bool | None = Field(None, description="Lumina-2: CFG rescaled to the conditional output's norm")
    shift: float | None = Field(None, gt=0, description="fixed-shift flow schedulers: the sampling grid's shift instead of the checkpoint's")
    frame_rate: float | None = Field(None, gt=0, description="LTX-Video, Cosmos-Predict2 Video2World: frames per "
                                     "second its rotary time axis is scaled to; None: the pipeline's (25, 16)")
    decode_timestep: float | None = Field(None, ge=0, le=1, description="LTX-Video 0.9.1+: the timestep its VAE "
                                          "decodes at (0.03 recommended for 0.9.1); None: the pipeline's 0")
    decode_noise_scale: float | None = Field(None, ge=0, le=1, description="LTX-Video 0.9.1+: the share of fresh "
                                             "noise mixed into the latents before decoding; None: decode_timestep")
    prior_seed: int | None = Field(None, ge=0, description="GLM-Image: the seed from which each prompt's prior "
                                   "tokens are sampled by its autoregressive model (with a digest of the prompt: "
                                   "one plan per prompt, the same in every rollout and replay); None: 0")
    decoder_steps: int | None = Field(None, ge=1, description="GLM-Image's autoregressive model (glm_image_ar): "
                                      "the diffusion decoder's ODE steps when its tokens are decoded; None: 50")
    decoder_guidance: float | None = Field(None, ge=1.0, description="glm_image_ar: the decoder's CFG scale "
                                           "(prior tokens dropped in the unconditional pass); None: 1.5")
    decoder_seed: int | None = Field(None, ge=0, description="glm_image_ar: the seed from which each prompt's "
                                     "decoder noise is drawn (with a digest of the prompt); None: 0")
    motion_speed: float | None = Field(None, gt=0, description="LTX-2 (ltx2, ltx2_i2v): the speed of the motion "
                                       "relative to real time — the rotary time axis reads frame_rate / motion_speed "
                                       "(0.2: 5× slow motion, as the Slow-Motion-Control LoRA); None: 1")
    image_crf: int | None = Field(None, ge=0, le=51, description="LTX-2 image-to-video (ltx2_i2v): the H.264 CRF "
                                  "the source is re-compressed at before it is encoded, as LTX-2 was trained; "
                                  "0: not re-compressed; None: the pipeline's (33 for Gemma-3 checkpoints)")
    av_guidance: AudioVideoGuidance = Field(default_factory=AudioVideoGuidance,
                                            description="LTX-2 (ltx2, ltx2_i2v): its guidance terms beside CFG")
    dynamic_cfg: bool | None = Field(None, description="CogVideoX (cogvideox, cogvideox_i2v): the pipeline's "
                                     "use_dynamic_cfg — a guidance scale that changes along the grid, as its "
                                     "official scripts sample; None: off")
    sigmas: list[float] | None = Field(None, min_length=1, description="the sampling grid's noise levels before the "
                                       "scheduler's shift, as the pipeline's `sigmas=` takes them — a distilled "
                                       "checkpoint's schedule (LTX-2's 8 DISTILLED_SIGMA_VALUES); sampling.steps and "
                                       "sampling.eval_steps equal its length; None: the pipeline's linspace(1, 1/T, T)")

    @field_validator("sigmas")
    @classmethod
    def _decreasing_noise_levels(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (any(not 0 < s <= 1 for s in v) or any(a <= b for a, b in zip(v, v[1:]))):
            raise ValueError(f"model.sigmas={v}: noise levels in (0, 1], strictly decreasing (the grid ends at 0 "
                             f"by itself), e.g. [1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875]")
        return v

    def size(self) -> int | tuple[int | None, int | None] | None:
        """What a family loads with (`Family.load(resolution=...)`): model.resolution's square
        side, or (height, width) where either is set — an unset one is model.resolution, or the
        checkpoint's default when that is unset too."""
        if self.height is None and self.width is None:
            return self.resolution
        return (self.height or self.resolution, self.width or self.resolution)

    def family_options(self) -> dict:
        """The settings only some families read, as `Family.load` keywords: those that are set."""
        keys = ("expert", "guidance_scale_2", "cfg_normalization", "shift", "frame_rate", "decode_timestep",
                "decode_noise_scale", "prior_seed",
                "decoder_steps", "decoder_guidance", "decoder_seed", "image_crf", "motion_speed", "sigmas", "dynamic_cfg")
        out = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        return out | self.av_guidance.model_dump(exclude_none=True)
