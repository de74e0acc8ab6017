"""What every family built on a diffusers pipeline shares: loading a checkpoint directory (layout
check, absent components, device, frozen towers), the resolution rule, the dynamic-shift μ of
the flow-matching pipelines, and the uint8 postprocess of decoded images. A family module keeps
only what is its own: conditioning, schedule, velocity and decode."""

from __future__ import annotations

import functools
import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from .base import ModelLoadError, check_layout, size_setting, torch_dtype


#: `model.sigmas`, for the families whose pipeline takes `sigmas=` (declared in their `options`)
SIGMAS_OPTION = {"sigmas": "the sampling grid's noise levels before the scheduler's shift, as the pipeline's "
                           "`sigmas=` takes them (a distilled checkpoint's schedule)"}


class PipelineFamily:
    """Base of the diffusers families: the loaded pipeline and its transformer, VAE and scheduler."""

    name: str
    pipeline_class: str  # the diffusers class, as model_index.json names it
    guidance: str = "cfg"
    text_tokens: tuple[int, int] = (1, 512)  # the prompt lengths the family's text encoder reads (model.max_sequence_length)
    video: bool = False  # decode gives clips [B, F, H, W, 3] (model.frames applies)
    #: model.* settings only some families read (name → what it sets); `load` takes them as keywords
    options: dict[str, str] = {}
    #: prompt conditioning comes from frozen text encoders apart from the trained module: a process
    #: that only trains (a Ray trainer rank) loads the family without them (`text_towers=False`) and
    #: replays with the rollout's own encodings
    separate_text_towers: bool = True
    #: the frozen components that only encode conditioning (name prefixes): the text encoders, and
    #: an image-conditioned family's image encoder; treated alike (not read by a trainer rank, offloaded)
    conditioning_towers: tuple[str, ...] = ("text_encoder",)
    #: the pipeline component that denoises (held as `self.transformer` whatever its kind): a
    #: transformer, or SD1.x/2.x's "unet"
    denoiser: str = "transformer"
    #: swapped components (`swap_components`) are handed to the pipeline's constructor, which reads
    #: them (a ProcessorMixin by type), instead of being set on the built pipeline
    swap_at_construction: bool = False
    #: components model_index.json may list that the family never reads (Cosmos's guardrail): no
    #: folder is required for them and none is loaded (the pipeline is given None)
    unread_components: tuple[str, ...] = ()

    def __init__(self, pipe, path: str, dtype: torch.dtype, max_sequence_length: int = 0,
                 resolution: int | tuple[int | None, int | None] | None = None, frames: int | None = None,
                 sigmas: list[float] | None = None):
        """`resolution`: a square side, or (height, width) — an unset one the checkpoint's default.
        `sigmas`: model.sigmas (only families declaring SIGMAS_OPTION are given it)."""
        self.pipe, self.path, self.dtype = pipe, path, dtype
        self.sigmas = None if sigmas is None else [float(s) for s in sigmas]
        if self.sigmas is not None and pipe.scheduler.config.get("use_flow_sigmas"):
            raise ModelLoadError(f"model.sigmas: the {type(pipe.scheduler).__name__} of {path!r} places its own "
                                 f"sigmas (use_flow_sigmas), so the pipeline ignores them; unset model.sigmas")
        self.max_sequence_length, self.frames = max_sequence_length, frames
        self.transformer, self.vae, self.scheduler = getattr(pipe, self.denoiser), pipe.vae, pipe.scheduler
        h, w = resolution if isinstance(resolution, tuple) else (resolution, resolution)
        default = self.default_resolution(pipe) if h is None or w is None else None
        dh, dw = default if isinstance(default, tuple) else (default, default)
        self.height, self.width = h or dh, w or dw  # the image (clip frame) size in pixels
        self._encode_device: torch.device | None = None  # set while the text towers rest in host memory
        self.without_text = False  # loaded with text_towers=False: prompt sets are encoded elsewhere

    @classmethod
    def load(cls, path: str | Path, dtype: str = "float32", device: str = "cpu", max_sequence_length: int = 512,
             resolution: int | tuple[int | None, int | None] | None = None, frames: int | None = None,
             trainable_device: str | None = None, text_towers: bool = True, **options):
        """`text_towers=False`: the text encoders are not read (tokenizers are); `encode_prompts`
        then refuses — for a process given its prompt conditioning (engines/prompt_cache.py)."""
        unknown = sorted(set(options) - set(cls.options))
        if unknown:
            raise ModelLoadError(f"model.{unknown[0]}: the {cls.name} family has no such setting "
                                 f"({', '.join(f'model.{k}' for k in cls.options) or 'none of its own'}); unset it")
        lo, hi = cls.text_tokens
        if not lo <= max_sequence_length <= hi:
            raise ModelLoadError(f"model.max_sequence_length={max_sequence_length}: the {cls.name} family reads "
                                 f"{lo}–{hi} prompt tokens")
        if frames is not None and not cls.video:
            raise ModelLoadError(f"model.frames={frames}: the {cls.name} family makes images; unset model.frames")
        return cls.from_directory(path, dtype, device, max_sequence_length, resolution, frames, trainable_device,
                                  text_towers, **options)

    @classmethod
    def pipeline_type(cls) -> type:
        """The class that loads the checkpoint: diffusers' `pipeline_class` (a family may load with
        a subclass that differs only in construction: Cosmos-Predict2's, without its guardrail)."""
        import diffusers

        return getattr(diffusers, cls.pipeline_class)

    @classmethod
    def trained_component(cls, options: dict) -> str:
        """The pipeline component the family trains (a two-expert checkpoint: the chosen expert)."""
        return cls.denoiser

    @classmethod
    def from_directory(cls, path: str | Path, dtype: str, device: str, max_sequence_length: int,
                       resolution: int | tuple | None, frames: int | None = None, trainable_device: str | None = None,
                       text_towers: bool = True, **options):
        """Load `path` with the family's diffusers pipeline class: every component except the
        trained transformer frozen, progress bars off; the size checked against the checkpoint.
        `trainable_device` keeps the trained transformer off `device`: "cpu", or "meta" (built from its
        config, no weights read: a sharded trainer rank that receives them from rank 0)."""
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()  # the loader's bars would garble the CLI's own progress
        p = check_layout(path, cls.pipeline_class, cls.name, skip=cls.unread_components)
        swapped = cls.swap_components(p)
        # components saved as [null, null] (e.g. SD3 without T5) must be passed as None explicitly
        index = json.loads((p / "model_index.json").read_text())
        absent = {k: None for k, v in index.items() if isinstance(v, list) and v[0] is None and k not in swapped}
        absent.update({k: None for k in cls.unread_components if k in index})
        if not text_towers:  # not read at all: a trainer rank replays with the rollout's encodings
            absent.update({k: None for k, v in index.items()
                           if k.startswith(cls.conditioning_towers) and isinstance(v, list)})
        trained = cls.trained_component(options)
        try:
            given = {trained: empty_transformer(p, dtype, trained)} if trainable_device == "meta" else {}
            early = {k: load() for k, load in swapped.items()} if cls.swap_at_construction else {}
            pipe = cls.pipeline_type().from_pretrained(
                str(p), dtype=torch_dtype(dtype), **absent, **{k: early.get(k) for k in swapped}, **given)
            for name, load in swapped.items():
                if name not in early:
                    setattr(pipe, name, load())
        except Exception as exc:  # diffusers raises many types; name the path and the cause
            raise ModelLoadError(f"could not load the {cls.pipeline_class} from {str(p)!r}: {exc}") from exc
        for key, module in pipe.components.items():
            if isinstance(module, torch.nn.Module):
                module.to(trainable_device or device if key == trained else device)
        pipe.set_progress_bar_config(disable=True)
        for key, module in pipe.components.items():
            if isinstance(module, torch.nn.Module) and key != trained:
                module.requires_grad_(False)
        fam = cls(pipe, str(p), torch_dtype(dtype), max_sequence_length, resolution, frames, **options)
        fam.without_text = not text_towers
        fam.check_size()
        return fam

    def check_size(self) -> None:
        """Both sides on the checkpoint's grid (a family adds its own limits)."""
        step = self.resolution_multiple(self.pipe)
        if self.height % step or self.width % step:
            raise ModelLoadError(f"{self.size_setting()}: this {self.name} checkpoint needs each side a multiple of {step} "
                                 "(the VAE's downsampling times the transformer's patch size)")

    def latent_grid(self, factor: int) -> tuple[int, int]:
        """(height, width) of the latent grid of a VAE that downsamples by `factor`."""
        return self.height // factor, self.width // factor

    def size_setting(self) -> str:
        """The family's size as the config sets it, for messages."""
        return size_setting(self.height, self.width)

    def grid_sigmas(self, steps: int, default):
        """The noise levels the pipeline's `sigmas=` is given: model.sigmas when set (a distilled
        checkpoint's schedule; `describe` records them), else `default` (the pipeline's own)."""
        if self.sigmas is None:
            return default
        if len(self.sigmas) != steps:
            raise ValueError(f"model.sigmas holds {len(self.sigmas)} noise levels and {steps} steps were asked; set "
                             f"sampling.steps and sampling.eval_steps to {len(self.sigmas)}")
        return list(self.sigmas)

    def set_shift(self, shift: float) -> None:
        """`model.shift`: the checkpoint's flow-matching grid under another fixed shift (DanceGRPO
        samples HunyuanVideo with 5, whose scheduler ships 7); `describe` records the one used."""
        cfg = self.scheduler.config
        if "shift" not in cfg or cfg.get("use_dynamic_shifting", False):
            why = "a resolution-dependent (dynamic) shift" if "shift" in cfg else "no shift setting"
            raise ModelLoadError(f"model.shift={shift}: the {type(self.scheduler).__name__} of {self.path!r} has "
                                 f"{why}; unset model.shift")
        self.scheduler = self.pipe.scheduler = type(self.scheduler).from_config(cfg, shift=float(shift))

    def set_clip_frames(self, step: int | None = None) -> None:
        """A video family's `model.frames` (its default when unset), which its causal VAE needs as
        k·(time compression) + 1 (`step`: the compression, when the pipeline names it otherwise)."""
        self.frames = self.frames or self.default_frames
        step = step or self.pipe.vae_scale_factor_temporal
        if (self.frames - 1) % step:
            raise ModelLoadError(f"model.frames={self.frames}: this VAE compresses time ×{step}, so a clip has "
                                 f"{step}k+1 frames (e.g. {self.default_frames}, or {(self.frames // step) * step + 1})")

    # --- text towers ----------------------------------------------------------------------------
    def text_towers(self) -> dict[str, torch.nn.Module]:
        """The pipeline's text encoders (`text_encoder`, `text_encoder_2`, …) and any other
        conditioning tower (`conditioning_towers`): frozen, used only to encode prompt sets."""
        return {k: m for k, m in self.pipe.components.items()
                if k.startswith(self.conditioning_towers) and isinstance(m, torch.nn.Module)}

    def offload_text_towers(self) -> None:
        """Keep the text towers in host memory and bring them to their device only while a prompt
        set is encoded (`model.offload_text_encoders`): their weights — T5-XXL 9.5 GB, Qwen2.5-VL
        16 GB, FLUX.2's Mistral 48 GB in bf16 — leave the accelerator to the transformer's update.
        Prompt sets are encoded on a prompt-cache miss (an iteration's prompts once, the negative
        prompt once), so the towers travel about twice an iteration. Encodings are unchanged: the
        same weights compute on the same device."""
        towers = self.text_towers()
        if towers and self._encode_device is None:
            self._encode_device = next(iter(towers.values())).device
            for m in towers.values():
                m.to("cpu")

    def encode_negative(self, text: str):
        """Classifier-free guidance's unconditional conditioning, as the pipeline encodes its
        `negative_prompt` — the prompt's own encoding in most pipelines; a family whose pipeline
        encodes it otherwise says so here (SANA without its instruction, Lumina-2 without its
        system prompt)."""
        return self.encode_prompts([text])

    @contextmanager
    def text_towers_resident(self):
        """The text towers on their device for the duration (a no-op unless offloaded)."""
        if self._encode_device is None:
            yield
            return
        towers = list(self.text_towers().values())
        for m in towers:
            m.to(self._encode_device)
        try:
            yield
        finally:
            for m in towers:
                m.to("cpu")

    @staticmethod
    def swap_components(path: Path) -> dict:
        """Components the family loads itself instead of the pipeline ({name: loader}); none by default."""
        return {}

    @staticmethod
    def default_resolution(pipe) -> int | tuple[int, int]:
        """The pipeline's default size: a square side (here: its `default_sample_size` latents), or
        (height, width) where the pipeline's default is not square."""
        return pipe.default_sample_size * pipe.vae_scale_factor

    @staticmethod
    def resolution_multiple(pipe) -> int:
        """Image sides the checkpoint can take: the VAE factor × the 2×2 packing (FLUX-style latents)."""
        return 2 * pipe.vae_scale_factor

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    def identity(self) -> str:
        """The conditioning's identity: family, checkpoint path, dtype, text length and image size
        (an editing family reads each source at the target's size)."""
        return f"{self.name}:{self.path}:{self.dtype}:{self.max_sequence_length}:{self.height}x{self.width}"

    def trainable_module(self) -> torch.nn.Module:
        return self.transformer

    def describe(self) -> dict:
        """Settings recorded with the rollouts: image side, scheduler shift (and the dynamic μ), guidance."""
        out = {"resolution": [self.height, self.width], "shift": self.scheduler.config.get("shift"),
               "guidance": self.guidance}
        if self.scheduler.config.get("use_dynamic_shifting", False) and hasattr(self, "_mu"):
            out["mu"] = self._mu()
        return out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [B, C, H, W] → uint8 [B, H, W, 3]: `decode_pixels`, quantised as the
        pipelines' postprocess (SD3, FLUX.1)."""
        return pixels_to_uint8(self.decode_pixels(latents))

    def decode_pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents [B, C, H, W] → images [B, 3, H, W] in [0, 1], differentiable (a reward-
        gradient algorithm backpropagates a reward through it): an AutoencoderKL's scaling and
        shift (none where its config has none: HunyuanImage-2.1), decode, [-1, 1] → [0, 1]."""
        cfg = self.vae.config
        z = latents.to(self.vae.dtype) / cfg.scaling_factor + (cfg.get("shift_factor") or 0.0)
        return unit_range(self.vae.decode(z, return_dict=False)[0])


def encodes_text(encode):
    """For a family's `encode_prompts`: the text towers are resident while it runs (offloaded
    towers come to their device and go back)."""
    @functools.wraps(encode)
    def wrapper(self, prompts, *args, **kwargs):
        if self.without_text:
            raise RuntimeError(f"this {self.name} model was loaded without its text encoders (text_towers=False, "
                               "as a Ray trainer rank loads it): its prompt conditioning must be given "
                               "(PromptCache.holding), not encoded here")
        with self.text_towers_resident():
            return encode(self, prompts, *args, **kwargs)
    return wrapper


def empty_transformer(path: Path, dtype: str, component: str = "transformer") -> torch.nn.Module:
    """The checkpoint's transformer (`component`) built from its config with its parameters on
    the meta device: structure and dtype, no storage, no weights read. Buffers and plain tensors
    made at construction (rotary tables) are real, as in a loaded one."""
    import diffusers
    import transformers
    from accelerate import init_empty_weights

    library, class_name = json.loads((path / "model_index.json").read_text())[component]
    if library != "diffusers":  # a trained transformers model (GLM-Image's autoregressive one; saved as its module)
        model_cls = getattr(transformers, class_name)
        with init_empty_weights(include_buffers=False):
            model = model_cls(transformers.AutoConfig.from_pretrained(str(path / component)))
        return model.to(torch_dtype(dtype))
    model_cls = getattr(diffusers, class_name)
    with init_empty_weights(include_buffers=False):
        model = model_cls.from_config(model_cls.load_config(str(path / component)))
    return model.to(torch_dtype(dtype))


class PackedLatentsFamily(PipelineFamily):
    """Families whose transformer reads 2×2-packed latents (FLUX.1, Qwen-Image): latents stay
    unpacked [C, H, W] for the sampler (C = the transformer's packed channels / 4), the schedule is
    the pipelines' `linspace(1, 1/T, T)` sigmas (or model.sigmas) with the dynamic shift of the
    packed sequence."""

    options = SIGMAS_OPTION

    def latent_shape(self) -> tuple[int, int, int]:
        h, w = packed_grid(self.height, self.width, self.pipe.vae_scale_factor)
        return self.transformer.config.in_channels // 4, h, w

    def _mu(self) -> float:
        _, h, w = self.latent_shape()
        return dynamic_shift_mu(self.scheduler, (h // 2) * (w // 2))

    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigmas [T+1] ending at 0, timesteps [T]) exactly as FluxPipeline and QwenImagePipeline set them."""
        from copy import deepcopy

        sched = deepcopy(self.scheduler)
        kwargs = {"mu": self._mu()} if sched.config.get("use_dynamic_shifting", False) else {}
        if sched.config.get("use_flow_sigmas"):  # FluxPipeline then lets the scheduler place them
            sched.set_timesteps(steps, device=self.device, **kwargs)
        else:
            sigmas = self.grid_sigmas(steps, np.linspace(1.0, 1 / steps, steps))
            sched.set_timesteps(sigmas=sigmas, device=self.device, **kwargs)
        return sched.sigmas.float().clone(), sched.timesteps.float().clone()


def packed_grid(height: int, width: int, vae_scale_factor: int) -> tuple[int, int]:
    """The latent grid of an image the transformer reads in 2×2 patches: each side's latents
    rounded down to even, as the packing pipelines (FLUX, Qwen-Image, Lumina-2, Z-Image) size it."""
    return 2 * (height // (vae_scale_factor * 2)), 2 * (width // (vae_scale_factor * 2))


def scheduler_grid(scheduler, steps: int, device, family: str, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(σ [T+1] ending at 0, timesteps [T]) exactly as a checkpoint's own scheduler sets them for
    its pipeline — a multistep flow solver too (DPMSolver, UniPC with `use_flow_sigmas`: SANA,
    Wan), whose grid the Euler/SDE kernels then step."""
    from copy import deepcopy

    sched = deepcopy(scheduler)
    sched.set_timesteps(steps, device=device)
    sigmas, timesteps = sched.sigmas.float().clone(), sched.timesteps.float().clone()
    if len(sigmas) != steps + 1 or float(sigmas[-1]) != 0.0 or len(timesteps) != steps:
        raise ValueError(f"the {type(sched).__name__} of {path!r} does not give a flow-matching σ grid ending at 0 "
                         f"for {steps} steps; {family} rollouts need a flow scheduler (use_flow_sigmas with "
                         f"final_sigmas_type='zero', or FlowMatchEulerDiscreteScheduler)")
    return sigmas.to(device), timesteps.to(device)


def dynamic_shift_mu(scheduler, image_seq_len: int, max_shift: float = 1.15) -> float:
    """μ of the resolution-dependent shift, from the scheduler's config with the pipelines'
    defaults (FLUX and Qwen-Image: max_shift 1.15; SD3: 1.16)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    c = scheduler.config
    return calculate_shift(image_seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                           c.get("base_shift", 0.5), c.get("max_shift", max_shift))


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """VAE output in [-1, 1], [B, 3, H, W] → uint8 [B, H, W, 3], as the pipelines postprocess."""
    return pixels_to_uint8(unit_range(images))


def unit_range(images: torch.Tensor) -> torch.Tensor:
    """VAE output in [-1, 1] → float pixels in [0, 1], as the pipelines postprocess (differentiable)."""
    return (images.float() / 2 + 0.5).clamp(0, 1)


def pixels_to_uint8(pixels: torch.Tensor) -> np.ndarray:
    """Images in [0, 1], [B, 3, H, W] → uint8 [B, H, W, 3] (round half to even, as numpy rounds)."""
    return (pixels.detach().permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)


def decodes_pixels(family) -> bool:
    """Whether a family (class or instance) has a differentiable decode that its `decode` quantises:
    `decode_pixels` defined on the class defining `decode` or below it (not a video VAE, …)."""
    mro = (family if isinstance(family, type) else type(family)).__mro__
    owner = lambda name: next((c for c in mro if name in vars(c)), None)  # noqa: E731
    decode, pixels = owner("decode"), owner("decode_pixels")
    return decode is not None and pixels is not None and issubclass(pixels, decode)
