"""Loads a policy for evaluation or generation: the embedded miniature, a diffusers directory,
a pixrl training checkpoint over its base model, or the `rollout` version of a named run."""

from __future__ import annotations

import json
from pathlib import Path

from ..artifacts.checkpoints import CONFIG, WEIGHTS
from ..artifacts.tracking import Tracker, default_tracking_uri
from ..config.loader import load_config
from ..config.schema import ExperimentConfig
from .policy import TrainablePolicy


class PolicyNotFound(FileNotFoundError):
    pass


def load_policy(checkpoint: str | None, run: str | None, workdir: str) -> tuple[TrainablePolicy, ExperimentConfig]:
    if checkpoint and run:
        raise PolicyNotFound("pass either --checkpoint or --run, not both")
    if run:
        tracker = Tracker(default_tracking_uri(Path(workdir)))
        ref = tracker.resolve(f"pixrl-{run}")
        if ref is None:
            raise PolicyNotFound(f"no published policy for run {run!r} in {workdir} (looked for "
                                 f"models:/pixrl-{run}@rollout); check --run and --workdir")
        ckpt = tracker.download(ref, Path(workdir) / "cache" / "policies" / f"{ref.model_name}-v{ref.version}.eval")
        return _from_pixrl_checkpoint(ckpt)
    if checkpoint:
        p = Path(checkpoint)
        if (p / WEIGHTS).is_file():
            return _from_pixrl_checkpoint(p)
        if (p / "model_index.json").is_file():
            cfg = load_config(None, [f"model.path={p}"])
            return TrainablePolicy(cfg), cfg
        raise PolicyNotFound(f"{checkpoint!r} is neither a pixrl checkpoint ({WEIGHTS}) nor a diffusers "
                             f"directory (model_index.json)")
    cfg = load_config(None, [])
    return TrainablePolicy(cfg), cfg


def load_policy_version(tracker: Tracker, run: str, alias: str, workdir: str):
    """A run's registered policy under an alias (rollout, champion) → (policy, config, ref)."""
    ref = tracker.resolve(f"pixrl-{run}", alias)
    if ref is None:
        raise PolicyNotFound(f"no version of models:/pixrl-{run} has alias {alias!r} in {workdir}; check the run "
                             f"name, or use alias rollout (champion needs run.eval_every)")
    ckpt = tracker.download(ref, Path(workdir) / "cache" / "policies" / f"{ref.model_name}-v{ref.version}.eval")
    policy, cfg = _from_pixrl_checkpoint(ckpt)
    return policy, cfg, ref


def _from_pixrl_checkpoint(ckpt: Path) -> tuple[TrainablePolicy, ExperimentConfig]:
    cfg = ExperimentConfig.model_validate(json.loads((ckpt / CONFIG).read_text()))
    policy = TrainablePolicy(cfg)
    policy.load_version(ckpt, None)
    return policy, cfg
