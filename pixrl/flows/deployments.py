"""Flows with typed parameters for the Prefect UI (prefect.yaml, `pixrl serve`): each takes one
pydantic model, so the UI renders a form with defaults and descriptions, and each resolves the
layered config exactly as the CLI does before calling the pipeline flow. Imports are absolute
because `prefect deploy` loads this file by path (prefect.yaml entrypoints)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from prefect import flow, get_run_logger

from pixrl.config.loader import load_config


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrainParameters(_Params):
    preset: str = Field("shapes_flow_grpo", description="experiment preset (pixrl/config/presets/experiment) or a YAML path")
    run_name: str = Field("default", description="run name: the MLflow run, the Lance table and model pixrl-<name>")
    iterations: int = Field(32, ge=1, description="RL iterations")
    seed: int = Field(0, description="run seed: prompt order and sampler noise")
    workdir: str = Field("work", description="directory of the stores: Lance, MLflow (sqlite), checkpoints")
    overrides: list[str] = Field(default_factory=list,
                                 description="extra key=value config overrides, e.g. algorithm.lr=3e-5 reward=jpeg_compressibility")


class DPOParameters(_Params):
    sources: list[str] = Field(..., min_length=1, description="run names, experiment:NAME or TABLE.lance[@version]")
    run_name: str = Field("dpo", description="name of the DPO run")
    steps: int = Field(200, ge=1, description="DPO optimizer steps")
    seed: int = Field(0, description="pair order and noise seed")
    workdir: str = Field("work", description="directory of the stores")
    preset: str = Field("shapes_dpo", description="offline experiment preset")
    overrides: list[str] = Field(default_factory=list, description="key=value overrides, e.g. algorithm.beta=50 dpo.margin=0.2")


class EvalParameters(_Params):
    run_name: str = Field(..., description="evaluate the published policy of this run")
    alias: str = Field("rollout", description="which of the run's versions: rollout (its newest) or champion (its best held-out)")
    split: str = Field("heldout", pattern="^(heldout|train)$", description="prompt split: heldout or train")
    per_category: int = Field(48, ge=1, description="samples per prompt category")
    workdir: str = Field("work", description="directory of the stores")
    weights: Literal["default", "average", "trained"] = Field(
        "default", description="a version trained with algorithm.ema: its average (the default where it has one) or "
                               "its trained weights")


@flow(name="pixrl-online")
def online_training(params: TrainParameters = TrainParameters()) -> dict:
    """Online RL (Flow-GRPO by default) on the configured model, reward and prompts."""
    from pixrl.flows.online import train

    cfg = load_config(params.preset, [*params.overrides, f"run.name={params.run_name}",
                                      f"run.iterations={params.iterations}", f"run.seed={params.seed}",
                                      f"run.workdir={params.workdir}"])
    return train(cfg.model_dump(mode="json"), params.workdir)


@flow(name="pixrl-dpo")
def offline_dpo_training(params: DPOParameters) -> dict:
    """Offline Diffusion-DPO on pairs mined from archived rollouts, pinned to their Lance versions."""
    from pixrl.config.schema import ExperimentConfig
    from pixrl.flows.offline_dpo import offline_dpo

    cfg = load_config(params.preset, [*params.overrides, f"run.name={params.run_name}", f"dpo.steps={params.steps}",
                                      f"run.seed={params.seed}", f"run.workdir={params.workdir}"])
    cfg = ExperimentConfig.model_validate({**cfg.model_dump(mode="json"),
                                           "dpo": {**cfg.dpo.model_dump(mode="json"), "source": params.sources}})
    return offline_dpo(cfg.model_dump(mode="json"), params.workdir)


@flow(name="pixrl-evaluate")
def evaluation(params: EvalParameters) -> dict:
    """Judge accuracy of a run's published policy, logged to that run (eval/<split>/...) and as a
    Prefect table artifact."""
    from pathlib import Path

    from prefect.artifacts import create_table_artifact

    from pixrl.artifacts.tracking import Tracker, default_tracking_uri
    from pixrl.datasets.registry import evaluate_split
    from pixrl.rewards.compose import RewardSet
    from pixrl.stages.inference import load_policy_version

    tracker = Tracker(default_tracking_uri(Path(params.workdir)))
    policy, cfg, ref = load_policy_version(tracker, params.run_name, params.alias, params.workdir,
                                           None if params.weights == "default" else params.weights)
    res = evaluate_split(policy.family, cfg.dataset, params.split, cfg.sampling, params.per_category,
                         RewardSet.from_config(cfg.reward, device=cfg.model.device))
    run_id = tracker.find_run("pixrl.run_name", params.run_name)
    tracker.log_metrics(run_id, {f"eval/{params.split}/{k}": v for k, v in res.items() if isinstance(v, float)},
                        step=ref.version)
    create_table_artifact([{"category": k, "accuracy": round(v, 4)} for k, v in res.items() if isinstance(v, float)],
                          key=_key(f"{params.run_name}-eval-{params.split}"),
                          description=f"{params.run_name} models:/{ref.model_name}@{params.alias} (v{ref.version})")
    get_run_logger().info("%s@%s v%d %s accuracy %.3f", ref.model_name, params.alias, ref.version, params.split,
                          res["accuracy"])
    return {**res, "model_name": ref.model_name, "version": ref.version}


def _key(text: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    import re

    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
