"""Publishing and evaluating a policy, shared by the online loop and offline training: a
checkpoint becomes a registered version (alias `rollout` moves last); an evaluation tags the
version with its held-out accuracy and may move the experiment's `champion` alias."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from ..artifacts.checkpoints import CheckpointRef, has_ema, verify_checkpoint
from ..artifacts.tracking import PolicyRef
from ..engines.base import Engine, PolicySource
from .completion import RunStores


def publish_checkpoint(stores: RunStores, iteration: int, ckpt: CheckpointRef, tags: dict[str, str],
                       before_alias: Callable[[], None] | None = None) -> tuple[PolicyRef, bool]:
    """(the version, whether it was registered now). Registered before a crash: the alias is
    made sure to have reached it, and nothing is registered twice."""
    done = stores.published(iteration)
    if done is not None:
        stores.tracker.move_alias(done)
        return done, False
    verify_checkpoint(Path(ckpt.uri))  # never publish a partial or corrupted checkpoint
    spec = stores.spec
    ref = stores.tracker.publish(spec.run_id, Path(ckpt.uri), iteration, spec.model_name, ckpt.checkpoint_id,
                                 {"run_name": spec.run_name, **tags}, before_alias=before_alias)
    return ref, True


def evaluate_policy(engine: Engine, stores: RunStores, source: PolicySource, policy: PolicyRef | None,
                    per_category: int) -> tuple[dict, bool]:
    """(held-out result of the run's dataset evaluator, whether `policy` became the champion).
    `policy` None or version 0: the base weights, which compete for nothing."""
    cfg = stores.spec.cfg
    res = engine.evaluate(evaluated_weights(source), cfg.dataset.name, "heldout", per_category)
    champion = bool(policy and policy.version > 0 and
                    stores.tracker.record_evaluation(policy, res["accuracy"], res["n"]))
    return res, champion


def evaluated_weights(source: PolicySource) -> PolicySource:
    """What a version is evaluated (and by default exported) as: its weight average when it was
    trained with algorithm.ema — as flow_grpo evaluates and saves the EMA — else its weights."""
    if source.checkpoint_dir is None or not has_ema(source.checkpoint_dir):
        return source
    return replace(source, ema=True)
