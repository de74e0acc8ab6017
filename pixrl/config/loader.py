"""Layered config: an experiment preset names one preset per group (model, sampling, algorithm,
reward, dataset, run); they are merged with OmegaConf in that order, then the experiment's own
overrides, then `key=value` overrides from the command line; pydantic validates the result.
Every failure names the offending key or preset and lists the valid choices.
"""

from __future__ import annotations

import copy
import difflib
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from pydantic import BaseModel, ValidationError

from ..errors import ExpectedError
from .schema import DPO_LOSS_KEYS, ExperimentConfig

GROUPS = ("model", "sampling", "algorithm", "reward", "dataset", "run", "dpo")
DEFAULT_EXPERIMENT = "shapes_flow_grpo"


class ConfigError(ExpectedError, ValueError):
    """A config that cannot be used; the message names the key and the fix."""


def presets_dir() -> Path:
    return Path(str(resources.files("pixrl.config") / "presets"))


def available_presets(group: str) -> list[str]:
    d = presets_dir() / group
    return sorted(p.stem for p in d.glob("*.yaml"))


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def _preset(group: str, name: str) -> dict:
    path = presets_dir() / group / f"{name}.yaml"
    if not path.is_file():
        choices = available_presets(group)
        hint = difflib.get_close_matches(name, choices, n=1)
        raise ConfigError(f"unknown {group} preset {name!r}"
                          + (f" (did you mean {hint[0]!r}?)" if hint else "")
                          + f"; available: {', '.join(choices)}")
    return _read_yaml(path)


def _experiment(ref: str | None) -> dict:
    ref = ref or DEFAULT_EXPERIMENT
    p = Path(ref)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise ConfigError(f"config file {ref!r} does not exist; pass a preset name "
                              f"({', '.join(available_presets('experiment'))}) or a YAML path")
        return _read_yaml(p)
    return _preset("experiment", ref)


def _parse_overrides(overrides: list[str]) -> dict:
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(f"overrides must look like key=value (e.g. sampling.steps=10); got {bad}")
    return OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)), resolve=True)


def compose(experiment: str | None = None, overrides: list[str] | None = None, base: dict | None = None) -> dict:
    """Merged plain dict (not yet validated). `base` (a resolved config, e.g. a parent run's)
    replaces the experiment preset. A group=name swap replaces that whole group: the preset and
    the experiment's own settings of it (an experiment's `dataset.categories` would otherwise
    filter a swapped-in prompt file by categories it does not have)."""
    exp = copy.deepcopy(base) if base is not None else _experiment(experiment)
    defaults = exp.pop("defaults", {}) or {}
    unknown_groups = set(defaults) - set(GROUPS)
    if unknown_groups:
        raise ConfigError(f"unknown preset group(s) {sorted(unknown_groups)} in defaults; groups: {', '.join(GROUPS)}")
    # a bare group=name swaps that group's preset (e.g. `reward=jpeg_compressibility`); dotted keys
    # then override single values, in either order on the command line
    overrides = list(overrides or [])
    for o in list(overrides):
        key, _, val = o.partition("=")
        if key in GROUPS and val and not val.startswith("{"):
            defaults[key] = val
            overrides.remove(o)
            exp.pop(key, None)
    cli = _moved_dpo_loss_keys(_parse_overrides(overrides))
    layers = [OmegaConf.create({g: _preset(g, n)}) for g, n in defaults.items()]
    merged = OmegaConf.merge(*layers, OmegaConf.create(exp), OmegaConf.create(cli))
    return OmegaConf.to_container(merged, resolve=True)


def _moved_dpo_loss_keys(cli: dict) -> dict:
    """Command-line dpo.beta=… (and timesteps, logit_mean, logit_std) → algorithm.* (their place
    since Diffusion-DPO is a registered algorithm), so an old command line still means the same."""
    dpo = cli.get("dpo")
    if not isinstance(dpo, dict) or not any(k in dpo for k in DPO_LOSS_KEYS):
        return cli
    algo = dict(cli.get("algorithm") or {})
    for k in DPO_LOSS_KEYS:
        if k in dpo:
            algo.setdefault(k, dpo[k])
    return {**cli, "dpo": {k: v for k, v in dpo.items() if k not in DPO_LOSS_KEYS}, "algorithm": algo}


def _keys_of(model: type[BaseModel], loc: tuple) -> list[str]:
    cur: Any = model
    for part in loc[:-1]:
        field = cur.model_fields.get(part) if isinstance(cur, type) and issubclass(cur, BaseModel) else None
        if field is None:
            return []
        cur = field.annotation
    return sorted(cur.model_fields) if isinstance(cur, type) and issubclass(cur, BaseModel) else []


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        key = ".".join(loc) or "<root>"
        if err["type"] == "extra_forbidden":
            valid = _keys_of(ExperimentConfig, loc)
            hint = difflib.get_close_matches(loc[-1], valid, n=1)
            lines.append(f"unknown key {key!r}" + (f" (did you mean {'.'.join(loc[:-1] + (hint[0],))!r}?)" if hint else "")
                         + f"; valid keys here: {', '.join(valid)}")
        elif not loc:  # a whole-config check: its message says it all
            lines.append(err["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"{key}: {err['msg']} (got {err.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(experiment: str | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> ExperimentConfig:
    raw = compose(experiment, overrides, base)
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def flatten(cfg: ExperimentConfig) -> dict[str, str]:
    """Dotted key → string, for MLflow params."""
    out: dict[str, str] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = str(obj)

    walk("", cfg.model_dump(mode="json"))
    return out
