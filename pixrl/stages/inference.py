"""Loads a policy for evaluation or generation: the embedded miniature, a diffusers directory,
a pixrl training checkpoint over its base model, or a named run's newest (or best) version."""

from __future__ import annotations

import json
from pathlib import Path

from ..artifacts.checkpoints import CONFIG, WEIGHTS, has_ema
from ..artifacts.tracking import CHAMPION_ALIAS, ROLLOUT_ALIAS, PolicyRef, Tracker, default_tracking_uri
from ..config.loader import load_config
from ..config.schema import ExperimentConfig
from ..engines.policy import EMA_SUFFIX, TrainablePolicy
from ..artifacts.model_export import ADAPTER_FORMATS, export_manifest
from ..models.registry import family_of_directory, get_family, registered_families
from ..errors import ExpectedError


class PolicyNotFound(ExpectedError, FileNotFoundError):
    pass


WEIGHT_CHOICES = ("average", "trained")


def load_policy(checkpoint: str | None, run: str | None, workdir: str, config: str | None = None,
                weights: str | None = None, model: dict | None = None) -> tuple[TrainablePolicy, ExperimentConfig]:
    """`config`: the experiment (preset or YAML) whose sampling settings — and, without a
    checkpoint or run, whose model — are evaluated (default: the default recipe's). `weights`
    (a pixrl checkpoint): "average" or "trained"; None: the average where it has one. `model`:
    model settings replaced (how it is loaded and sampled, e.g. another image size)."""
    if checkpoint and run:
        raise PolicyNotFound("pass either --checkpoint or --run, not both")
    if run:
        ckpt, _ = _run_checkpoint(Tracker(default_tracking_uri(Path(workdir))), run, ROLLOUT_ALIAS, workdir)
        return _from_pixrl_checkpoint(ckpt, model, weights=weights)
    if checkpoint:
        p = Path(checkpoint)
        if (p / WEIGHTS).is_file():
            return _from_pixrl_checkpoint(p, model, weights=weights)
        exported = export_manifest(p)  # a directory `pixrl export-model` wrote
        if exported and exported.get("format") in ADAPTER_FORMATS:
            raise PolicyNotFound(f"{checkpoint!r} holds an exported {exported['format']} adapter (its base: "
                                 f"{exported.get('base')!r}), not a whole model; pass the version it came from "
                                 "(--run NAME, or its pixrl checkpoint), or export it with --merge")
        family = family_of_directory(p)  # a base model, or an exported whole one
        if family is not None:
            cfg = load_config(config, _directory_model(p, family, config, exported)
                              + [f"model.{k}={v}" for k, v in (model or {}).items()])
            return TrainablePolicy(cfg), cfg
        raise PolicyNotFound(f"{checkpoint!r} is neither a pixrl checkpoint ({WEIGHTS}) nor a model directory of a "
                             f"registered family (a diffusers pipeline's model_index.json or a Janus-Pro config.json "
                             f"naming one of: {', '.join(get_family(f).pipeline_class for f in registered_families())})")
    cfg = load_config(config, [f"model.{k}={v}" for k, v in (model or {}).items()])
    return TrainablePolicy(cfg), cfg


def _directory_model(path: Path, family: str, config: str | None, exported: dict | None) -> list[str]:
    """The model overrides for a model directory of `family`: the settings an export recorded,
    or else the family with its full prompt length when the experiment's model is another
    family's (the default recipe's is the miniature's, which reads no T5)."""
    if exported is not None:
        return [f"model.{k}={v}" for k, v in exported.get("model", {}).items()] + [f"model.path={path}"]
    out = [f"model.family={family}", f"model.path={path}"]
    if load_config(config, []).model.family != family:
        out.append(f"model.max_sequence_length={getattr(get_family(family), 'text_tokens', (0, 0))[1]}")
    return out


def _run_checkpoint(tracker: Tracker, run: str, alias: str, workdir: str) -> tuple[Path, PolicyRef]:
    """A run's version by alias, its checkpoint materialised in the work directory's policy cache."""
    ref = run_policy_ref(tracker, run, alias, workdir)
    return tracker.download(ref, Path(workdir) / "cache" / "policies" / f"{ref.model_name}-v{ref.version}.eval"), ref


def run_policy_ref(tracker: Tracker, run: str, alias: str, workdir: str) -> PolicyRef:
    """A run's version in its experiment's registered model: `rollout` = the run's newest published
    version, `champion` = its best held-out evaluation (the experiment-wide aliases may point at
    other runs' versions; these are this run's)."""
    run_id = tracker.find_run("pixrl.run_name", run)
    if run_id is None:
        raise PolicyNotFound(f"no run named {run!r} in {workdir}; `pixrl runs --workdir {workdir}` lists the runs")
    model = tracker.client.get_run(run_id).data.tags.get("pixrl.model_name", "")
    if alias == ROLLOUT_ALIAS:
        ref = tracker.latest_of_run(model, run_id)
    elif alias == CHAMPION_ALIAS:
        ref = tracker.champion_of_run(model, run_id)
    else:
        raise PolicyNotFound(f"unknown alias {alias!r}; use {ROLLOUT_ALIAS} or {CHAMPION_ALIAS}")
    if ref is None:
        hint = "it has published nothing yet" if alias == ROLLOUT_ALIAS else \
            "none of its versions was evaluated (set run.eval_every), or use alias rollout"
        raise PolicyNotFound(f"run {run!r} has no {alias} version in models:/{model} ({hint})")
    return ref


def load_policy_version(tracker: Tracker, run: str, alias: str, workdir: str, weights: str | None = None):
    """A run's registered policy by alias (rollout, champion) → (policy, config, ref), as it is
    evaluated (its weight average where it has one) unless `weights` says which."""
    ckpt, ref = _run_checkpoint(tracker, run, alias, workdir)
    policy, cfg = _from_pixrl_checkpoint(ckpt, weights=weights)
    return policy, cfg, ref


def load_version_to_export(checkpoint: str | None, run: str | None, alias: str, workdir: str,
                           device: str = "cpu", weights: str | None = None) -> tuple[TrainablePolicy, ExperimentConfig, dict]:
    """A trained version (a pixrl checkpoint directory, or a run's version by alias) loaded over
    its base model on `device`, as saved (no activation checkpointing, no tower offload):
    (policy, config, where it came from). `weights` as in `load_policy`."""
    if bool(checkpoint) == bool(run):
        raise PolicyNotFound("pass one of --checkpoint DIR (a pixrl checkpoint) or --run NAME")
    if run:
        ckpt, ref = _run_checkpoint(Tracker(default_tracking_uri(Path(workdir))), run, alias, workdir)
        source = {"run": run, "alias": alias, "model": ref.model_name, "version": ref.version}
    else:
        ckpt = Path(checkpoint)
        if not (ckpt / WEIGHTS).is_file():
            raise PolicyNotFound(f"{checkpoint!r} is not a pixrl checkpoint (no {WEIGHTS}): export a trained version — "
                                 "a checkpoint directory under <workdir>/checkpoints, or --run NAME")
        source = {"checkpoint": str(ckpt.resolve())}
    model = {"device": device, "gradient_checkpointing": False, "offload_text_encoders": False}
    policy, cfg = _from_pixrl_checkpoint(ckpt, model, weights)
    average = policy.weights_id.endswith(EMA_SUFFIX)
    return policy, cfg, {**source, "checkpoint_id": policy.weights_id.removesuffix(EMA_SUFFIX),
                         "weights": "average" if average else "trained"}


def _from_pixrl_checkpoint(ckpt: Path, model: dict | None = None,
                           weights: str | None = None) -> tuple[TrainablePolicy, ExperimentConfig]:
    """`model`: settings of the model section replaced (how it is loaded, not what it is);
    `weights`: "average" (algorithm.ema's; refused where it has none), "trained", or None: the
    average where the checkpoint has one — what the run evaluated it as."""
    if weights not in (None, *WEIGHT_CHOICES):
        raise PolicyNotFound(f"--weights must be one of {', '.join(WEIGHT_CHOICES)}, got {weights!r}")
    cfg = ExperimentConfig.model_validate(json.loads((ckpt / CONFIG).read_text()))
    if model:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update=model)})
    average = weights == "average" or (weights is None and has_ema(ckpt))
    policy = TrainablePolicy(cfg)
    policy.load_version(ckpt, None, ema=average)
    return policy, cfg
