"""The Family protocol: what every model family provides to samplers, the trainer and the
stores, whatever its regime. Samplers and algorithms dispatch on `semantics`, never on names.

Device rule: everything a family creates — conditioning, schedules, noise generators,
latents — lives on the model's device (`family.device`). Only the store boundary (the engine
turning a rollout into a batch for Lance) moves tensors to host. Log-prob math runs in float32
whatever the compute dtype (`model.dtype`): the step kernels upcast.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from ..errors import ExpectedError
from .taxonomy import PolicySemantics

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


class ModelLoadError(ExpectedError, RuntimeError):
    """A model path or checkpoint that cannot be loaded; the message says how to fix it."""


def check_layout(path: str | Path, pipeline_class: str, family: str, skip: tuple[str, ...] = ()) -> Path:
    """A diffusers pipeline directory of `pipeline_class`, or a ModelLoadError saying what to set.
    `skip`: components the family never reads (their folders are neither required nor checked)."""
    p = Path(path)
    index = p / "model_index.json"
    if not index.is_file():
        raise ModelLoadError(f"model path {str(p)!r} is not a diffusers {pipeline_class} directory (no "
                             f"model_index.json there); set model.path to a local checkout in the diffusers "
                             f"layout, or write a tiny one with `pixrl tiny {family} --out DIR`")
    spec = json.loads(index.read_text())
    found = spec.get("_class_name")
    if found != pipeline_class:
        raise ModelLoadError(f"{str(p)!r} holds a {found}, not a {pipeline_class}; set model.family to the "
                             f"family of that pipeline (or model.path to a {pipeline_class} checkout)")
    components = {name: entry for name, entry in spec.items()
                  if isinstance(entry, list) and len(entry) == 2 and entry[0] is not None and name not in skip}
    missing = [f"{name}/ ({entry[1]})" for name, entry in components.items() if not (p / name).is_dir()]
    if missing:
        raise ModelLoadError(f"{str(p)!r} lacks {', '.join(missing)}, which its model_index.json lists for the "
                             f"{family} family's {pipeline_class}; the checkout is incomplete (copy the missing "
                             f"component folders)")
    for name, entry in components.items():
        cfg = _component_config(p / name)
        found_kind = _component_kind(cfg)
        if not found_kind or entry[1] in (cfg.get("architectures") or []):
            continue  # the config was saved by the declared class: its kind is that class's
        want_kind = _declared_kind(*entry)
        if want_kind and found_kind != want_kind:
            raise ModelLoadError(f"{str(p)!r}: component {name}/ holds a {found_kind[1]} model, but "
                                 f"model_index.json declares a {entry[1]} ({want_kind[1]}) for the {family} "
                                 f"family's {pipeline_class}; the folder comes from another checkpoint "
                                 f"(copy {name}/ from a matching {pipeline_class} checkout)")
    return p


def weight_names(path: Path) -> set[str]:
    """Tensor names of a transformers checkpoint (safetensors, one file or an index)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    single = path / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return set(f.keys())
    raise ModelLoadError(f"{str(path)!r} has no model.safetensors (or index); a checkpoint in the transformers "
                         f"layout ships its weights as safetensors")


def size_setting(height: int, width: int) -> str:
    """A size as the config sets it, for messages: model.resolution=R, or model.height/width."""
    return f"model.resolution={height}" if height == width else f"model.height={height}, model.width={width}"


def _component_config(folder: Path) -> dict:
    """A saved component's config.json ({} for tokenizers, schedulers, processors: nothing to compare)."""
    cfg_file = folder / "config.json"
    return json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}


def _component_kind(cfg: dict) -> tuple[str, str] | None:
    """What a saved model component is: ("diffusers", class name) or ("transformers", model_type).
    A transformers config that names the declared class in `architectures` was saved by it, so its
    kind needs no import of the class (importing a modeling module, e.g. CLIP's, is seconds of a
    run's start-up); check_layout then skips the comparison."""
    if "_class_name" in cfg:
        return "diffusers", cfg["_class_name"]
    return ("transformers", cfg["model_type"]) if "model_type" in cfg else None


def _declared_kind(library: str, class_name: str) -> tuple[str, str] | None:
    """The kind model_index.json declares: a diffusers class by name, a transformers class by its model_type."""
    if library == "diffusers":
        return "diffusers", class_name
    if library == "transformers":
        import transformers

        try:
            config_class = getattr(getattr(transformers, class_name, None), "config_class", None)
        except ImportError:  # a class whose optional backend is absent: nothing to compare against
            return None
        model_type = getattr(config_class, "model_type", None)
        return ("transformers", model_type) if model_type else None
    return None


@runtime_checkable
class Conditioning(Protocol):
    """A family-owned batch of prompt conditioning (SD3: embeddings + pooled; FLUX: T5 + CLIP
    pooled + ids; a token family: input ids). Rows can be picked and broadcast."""

    def select(self, idx) -> "Conditioning": ...

    def expand(self, n: int) -> "Conditioning": ...


def conditioning_to(cond, device):
    """A conditioning (a family's dataclass of tensors, possibly nested) with every tensor on
    `device`: how encodings travel between processes (host memory) and arrive (the model's device).
    A copy, bit for bit."""
    if isinstance(cond, torch.Tensor):
        return cond.to(device)
    if dataclasses.is_dataclass(cond) and not isinstance(cond, type):
        return dataclasses.replace(cond, **{f.name: conditioning_to(getattr(cond, f.name), device)
                                            for f in dataclasses.fields(cond) if f.init})
    if cond is None or isinstance(cond, (str, int, float, bool)):
        return cond
    if isinstance(cond, tuple):  # e.g. a grid size
        return tuple(conditioning_to(c, device) for c in cond)
    raise TypeError(f"cannot move a {type(cond).__name__} between devices: a family's conditioning is a "
                    "dataclass of tensors")


def uses_negative_prompt(family, guidance_scale: float) -> bool:
    """Whether sampling at this scale batches a negative (empty) prompt: classifier-free guidance
    ("cfg") does above 1; a guidance-distilled model ("embedded", FLUX.1-dev) takes the scale as
    an input and never does."""
    return guidance_scale > 1 and getattr(family, "guidance", "cfg") == "cfg"


def negative_prompt_of(family, recipe) -> str | None:
    """The negative prompt that sampling with `recipe` batches (its `negative_prompt`), or None
    where it batches none: no recipe, no CFG, a guidance-distilled or a token family."""
    scale = getattr(recipe, "guidance_scale", None)
    if scale is None or not uses_negative_prompt(family, scale):
        return None
    return getattr(recipe, "negative_prompt", "")


def replay_negative(family, recipe, algorithm) -> str | None:
    """The negative prompt an update's replay encodes: the one sampling with `recipe` batched, or,
    for an algorithm that guides a reference the rollout did not guide (`guides_reference`), the
    recipe's negative prompt on a CFG family."""
    text = negative_prompt_of(family, recipe)
    if text is None and getattr(algorithm, "guides_reference", False) and getattr(family, "guidance", "cfg") == "cfg":
        text = getattr(recipe, "negative_prompt", None)
    return text


def decode_images(family, latents, prompts: list[str] | None = None):
    """`family.decode(latents)`, given the rows' prompts where its decoder reads them
    (`decode_reads_prompts`: GLM-Image's autoregressive mode renders each prompt's quoted text)."""
    if not getattr(family, "decode_reads_prompts", False):
        return family.decode(latents)
    if prompts is None or len(prompts) != len(latents):
        raise ValueError(f"the {family.name} family decodes with each row's prompt; {len(latents)} rows came with "
                         f"{'no' if prompts is None else len(prompts)} prompts")
    return family.decode(latents, list(prompts))


class Family(Protocol):
    """A loaded model of one family (the common part of every regime)."""

    name: str
    pipeline_class: str  # the diffusers/transformers class named in the checkpoint's model_index.json
    semantics: PolicySemantics
    lora_targets: list[str]
    dtype: torch.dtype
    guidance: str  # "cfg" (negative-prompt batch) or "embedded" (the scale is a model input)
    # True when prompts are encoded by frozen text towers apart from the trained module: `load`
    # then takes text_towers=False (a trainer rank given the rollout's encodings). Absent: False
    # (Janus-Pro: prompts are token ids its trained language model reads)
    separate_text_towers: bool
    # Optional `fsdp_units(module) -> [parts]`: what FSDP shards when the family calls parts of
    # its trainable module directly (default: each block, then the module; engines/fsdp.py).

    @classmethod
    def load(cls, path: str | Path, dtype: str = "float32", device: str = "cpu", **options) -> "Family": ...

    @property
    def device(self) -> torch.device: ...

    def encode_prompts(self, prompts: list[str]) -> Conditioning: ...

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """uint8 images [B, H, W, 3] (or video [B, F, H, W, 3]); a family whose decoder reads the
        prompts (`decode_reads_prompts`) takes them as a second argument (`decode_images`)."""

    def trainable_module(self) -> torch.nn.Module: ...

    def identity(self) -> str:
        """What makes two loaded models' prompt encodings equal (cache key of the encoder)."""

    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """Write a tiny random checkpoint of the family in its real on-disk layout (`pixrl tiny`);
        returns the config overrides that run it."""


class DenoiseFamily(Family, Protocol):
    """The step interface of denoise families (flow matching): a velocity model and its schedule.
    Optional `cfg_truncation_by` ("step" or "time"): the rule of its pipeline's CFG truncation
    (algorithms/sampling.guidance_at)."""

    def encode_negative(self, text: str) -> Conditioning:
        """Classifier-free guidance's unconditional conditioning of `text`, as the family's
        pipeline encodes its `negative_prompt` (PipelineFamily: as a prompt)."""

    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigmas [T+1] ending at 0, timesteps [T]) on the model's device."""

    def latent_shape(self) -> tuple[int, ...]: ...

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: Conditioning,
                 guidance_scale: float = 1.0, neg: Conditioning | None = None) -> torch.Tensor: ...

    def describe(self) -> dict:
        """Settings recorded in every trajectory row's recipe (resolution, scheduler shift, …)."""


class TokenFamily(Family, Protocol):
    """The step interface of token-autoregressive families (Janus-Pro): logits per row, conditional
    rows first and — with guidance — the unconditional ones after them; the shared token sampler
    (algorithms/token_sampling.py) applies guidance, temperature and top-k."""

    def image_token_count(self) -> int: ...

    def first_logits(self, cond: Conditioning, guided: bool) -> tuple[torch.Tensor, object]:
        """(logits [R, V] of the first image token, the decode state after the prompt)."""

    def next_logits(self, state: object, tokens: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Feed the sampled tokens [B]; (logits [R, V] of the next one, the new state)."""

    def sequence_logits(self, cond: Conditioning, tokens: torch.Tensor, guided: bool) -> torch.Tensor:
        """Teacher-forced logits [R, N, V] of every token of `tokens` [B, N] (differentiable)."""

    def decode(self, tokens: torch.Tensor) -> np.ndarray:
        """uint8 images [B, H, W, 3] of image-token sequences [B, N]."""
