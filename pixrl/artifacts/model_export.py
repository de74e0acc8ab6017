"""A trained policy version written in the formats its base model's own library loads, so what
pixrl trained is used without pixrl (`pixrl export-model`):

- a diffusers family under LoRA: `pytorch_lora_weights.safetensors` as diffusers' LoRA loaders
  write it (`<Pipeline>.save_lora_weights`, the adapter's LoraConfig in the file's metadata):
  `pipe.load_lora_weights(OUT)` on the base pipeline (a two-expert Wan2.2's low-noise expert:
  `load_into_transformer_2=True`); a pipeline without LoRA loaders (HunyuanVideo-1.5): the same
  file written by the model's `save_lora_adapter`, `pipe.transformer.load_lora_adapter(OUT, weight_name=…, prefix=None)`;
- a diffusers family fully fine-tuned, or with `merge`: a whole pipeline directory — the base's
  components copied (or hard-linked), the trained one (`transformer`, or `transformer_2`) written
  by its own `save_pretrained`: `<Pipeline>.from_pretrained(OUT)`;
- Janus-Pro under LoRA: a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`):
  `model.load_adapter(OUT)`; fully fine-tuned or merged: a transformers checkpoint directory.

`pixrl_export.json` beside them says what was exported from where, with which model settings
(pixrl's `--checkpoint DIR` reads them back), and how to load it. The
directory is written under a temporary name and renamed into place: complete or absent, and an
existing one is never overwritten."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from ..errors import ExpectedError

MANIFEST = "pixrl_export.json"
LORA_FILE = "pytorch_lora_weights.safetensors"
ADAPTER_FORMATS = ("diffusers-lora", "peft-adapter")  # exports that need their base model to load
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


class ExportError(ExpectedError, RuntimeError):
    """An export that cannot be written (the destination exists, the base model is gone)."""


def merge_lora_(module: torch.nn.Module) -> int:
    """Fold every LoRA adapter of `module` into its base weights (W + s·B·A, peft's own merge) and
    put the plain layers back, in place: the module is then an ordinary one of its class, saved
    with its usual names. Returns how many layers were merged."""
    from diffusers.utils.peft_utils import recurse_remove_peft_layers
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.merge(safe_merge=True)  # raises on NaN/inf instead of writing them
    recurse_remove_peft_layers(module)
    if hasattr(module, "peft_config"):  # transformers/diffusers' "adapters loaded" marks: saved whole now
        del module.peft_config
    module._hf_peft_config_loaded = False
    return len(layers)


def export_manifest(path: Path) -> dict | None:
    """The manifest of a directory `export_policy` wrote (None: not one)."""
    manifest = Path(path) / MANIFEST
    return json.loads(manifest.read_text()) if manifest.is_file() else None


def _copy_tree(src: Path, dst: Path, link: bool, skip=lambda p: False) -> None:
    """Copy `src` into `dst` (files hard-linked instead when `link` and the filesystem allows)."""
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if skip(rel):
            continue
        target = dst / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if link:
            try:
                os.link(path, target)
                continue
            except OSError:  # another filesystem: copy
                pass
        shutil.copy2(path, target)


def _lora_config(module: torch.nn.Module) -> dict:
    cfg = module.peft_config["default"].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in cfg.items()}


def _export_pipeline(policy, cfg, stage: Path, merge: bool, link: bool) -> dict:
    from peft.utils import get_peft_model_state_dict

    fam, module = policy.family, policy.module
    base = Path(fam.path)
    component = type(fam).trained_component(cfg.model.family_options())
    pipeline = type(fam.pipe).__name__
    regrid = "" if cfg.model.shift is None else (  # the grid it sampled on (model.shift), for an adapter's base
        f"; pipe.scheduler = diffusers.{type(fam.scheduler).__name__}.from_config(pipe.scheduler.config, "
        f"shift={cfg.model.shift})")
    if policy.lora and not merge and not hasattr(module, "save_lora_adapter"):
        raise ExportError(f"the {fam.name} family's {type(module).__name__} has no LoRA loader in diffusers, so an "
                          "adapter file would load nowhere; export with --merge (the adapter folded into whole weights)")
    if policy.lora and not merge and not hasattr(type(fam.pipe), "save_lora_weights"):
        # a pipeline without diffusers' LoRA loaders (HunyuanVideo-1.5): the model's own adapter file
        module.save_lora_adapter(str(stage), adapter_name="default", safe_serialization=True)
        return {"format": "diffusers-lora", "files": [LORA_FILE], "component": component, "lora": _lora_config(module),
                "load": f"pipe = diffusers.{pipeline}.from_pretrained(BASE); "
                        f"pipe.{component}.load_lora_adapter(OUT, weight_name=\"{LORA_FILE}\", prefix=None){regrid}"}
    if policy.lora and not merge:
        layers, lora = get_peft_model_state_dict(module), _lora_config(module)
        target = "unet" if component == "unet" else "transformer"  # the keyword the pipeline's LoRA loader takes
        type(fam.pipe).save_lora_weights(str(stage), **{f"{target}_lora_layers": layers,
                                                         f"{target}_lora_adapter_metadata": lora},
                                         safe_serialization=True)
        into = ", load_into_transformer_2=True" if component == "transformer_2" else ""
        return {"format": "diffusers-lora", "files": [LORA_FILE], "component": component, "lora": lora,
                "load": f"pipe = diffusers.{pipeline}.from_pretrained(BASE); pipe.load_lora_weights(OUT{into}){regrid}"}
    merged = merge_lora_(module) if policy.lora else 0
    _copy_tree(base, stage, link, skip=lambda rel: rel.parts[0] == component)
    module.save_pretrained(str(stage / component), safe_serialization=True)
    if cfg.model.shift is not None:  # the scheduler as it sampled (model.shift): from_pretrained(OUT) samples so
        shutil.rmtree(stage / "scheduler", ignore_errors=True)
        fam.scheduler.save_pretrained(str(stage / "scheduler"))
    return {"format": "diffusers-pipeline", "component": component, "merged_lora_layers": merged,
            "linked": link, "load": f"pipe = diffusers.{pipeline}.from_pretrained(OUT)"}


def _export_transformers(policy, stage: Path, merge: bool, link: bool) -> dict:
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    fam, module = policy.family, policy.module
    base = Path(fam.path)
    cls = type(module).__name__
    if policy.lora and not merge:
        config = module.peft_config["default"]
        config.base_model_name_or_path = str(base)
        config.save_pretrained(str(stage))
        layers = {f"base_model.model.{k}": v.detach().contiguous().cpu()
                  for k, v in get_peft_model_state_dict(module).items()}  # PEFT's on-disk key form
        save_file(layers, str(stage / "adapter_model.safetensors"), metadata={"format": "pt"})
        return {"format": "peft-adapter", "files": ["adapter_config.json", "adapter_model.safetensors"],
                "lora": _lora_config(module),
                "load": f"model = transformers.{cls}.from_pretrained(BASE); model.load_adapter(OUT)"}
    merged = merge_lora_(module) if policy.lora else 0
    _copy_tree(base, stage, link, skip=lambda rel: rel.name.endswith(_WEIGHT_SUFFIXES))
    module.save_pretrained(str(stage), safe_serialization=True)
    return {"format": "transformers-checkpoint", "merged_lora_layers": merged, "linked": link,
            "load": f"model = transformers.{cls}.from_pretrained(OUT)"}


def export_policy(policy, cfg, out: Path, merge: bool = False, link: bool = False,
                  source: dict | None = None) -> dict:
    """Write `policy` (a TrainablePolicy holding the version to export) to `out`; returns the
    manifest. `merge`: a LoRA policy is folded into whole weights instead of written as an adapter."""
    out = Path(out)
    if out.exists():
        raise ExportError(f"{out} already exists; refusing to overwrite it — choose a new --out")
    base = Path(policy.family.path)
    if not base.is_dir():
        raise ExportError(f"the base model {str(base)!r} this policy was trained from is gone; the export copies its "
                          "other components — restore it (or set model.path) and export again")
    stage = out.with_name(f"{out.name}.staging-{uuid.uuid4().hex[:8]}")
    stage.mkdir(parents=True)
    try:
        if getattr(policy.family, "separate_text_towers", False):
            info = _export_pipeline(policy, cfg, stage, merge, link)
        else:
            info = _export_transformers(policy, stage, merge, link)
        settings = cfg.model.model_dump(include={"family", "dtype", "max_sequence_length", "resolution", "height",
                                                 "width", "frames", *cfg.model.family_options()})
        manifest = {"family": cfg.model.family, "base": str(base), "source": source or {},
                    "model": {k: v for k, v in settings.items() if v is not None}, **info}
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        stage.rename(out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return manifest
