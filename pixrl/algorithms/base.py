"""What an RL algorithm provides to the loop, and the registry that names algorithms.

The engine never branches on algorithm names: it asks the algorithm which trajectory fields it
needs stored (preflight refuses a run or an offline source that lacks them), for advantages
from rewards and groups, which samples train, and for the losses of a micro-batch of stored
rollouts. `losses(batch, policy)` owns the loop over stored steps through the shared replay
step and yields one loss term at a time: the trainer calls backward on each before the next is
computed, so only one step's graph is alive (as flow_grpo's trainer does). It also shapes its
own rollouts — `rollout_recipe` (the step kernel, which steps are stochastic and which stored),
`sampling_weights` (a separate sampling policy, DiffusionNFT's) — so a new algorithm (the seeds'
DanceGRPO, MixGRPO, GRPO-Guard, Flow-DPPO, DiffusionNFT) is one module here + its presets + its
tests, never an edit to the stages or the engine.
"""

from __future__ import annotations

import difflib
from abc import ABC, abstractmethod
from typing import Iterator

from pydantic import BaseModel, ConfigDict, ValidationError

import numpy as np
import torch

from ..config.loader import ConfigError
from ..config.registry import Registry
from ..config.schema import AlgorithmConfig, SamplingConfig
from .advantages import GroupAdvantages
from .recipe import rollout_recipe
from .replay import ReplayPolicy
from .sampling import SamplerRecipe
from .token_sampling import TokenRecipe


class NoSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Algorithm(ABC):
    """Subclasses set `Settings`: a pydantic model (extra keys forbidden) of their own keys in the
    `algorithm` config section, beside the shared ones of AlgorithmConfig."""

    name: str = ""
    Settings: type[BaseModel] = NoSettings
    #: trajectory fields the update reads back from the store
    needs: frozenset[str] = frozenset()
    #: trains from archived rollouts (preference pairs), not inside the online loop
    offline: bool = False
    #: its advantages pick pairs within each group from the total reward (reward.aggregate=reward)
    pairs_in_groups: bool = False
    #: samples and trains without a negative-prompt batch: a CFG family at guidance 1 (preflight
    #: refuses another scale), a guidance-distilled family at its embedded scale (FLUX.1-dev's 3.5)
    cfg_free: bool = False

    def __init__(self, cfg: AlgorithmConfig):
        self.cfg = cfg
        self.settings = _own_settings(self.Settings, self.name or cfg.name, cfg.model_extra or {})

    @property
    def needs_reference(self) -> bool:
        """Whether transition_loss wants the reference policy's step (e.g. KL with β > 0)."""
        return False

    #: the KL reference is the algorithm's own (its state: `reference_weights`), not the base model
    reference_in_state: bool = False

    @property
    def guides_reference(self) -> bool:
        """Whether the loss guides a reference with the negative prompt (DGPO's kl_cfg) even where
        the rollout batched none: the replay then encodes the recipe's negative prompt (CFG families)."""
        return False

    def reference_weights(self) -> dict[str, torch.Tensor] | None:
        """With `reference_in_state`: the reference's trainable weights (None: the base model's)."""
        return None

    def advantage_scores(self) -> list[str]:
        """Stored scores (rewards or their components) `advantages` reads beside the total; the
        stage passes them as `scores={name: [N]}`."""
        return []

    def scores_read(self) -> list[str]:
        """Every stored score the algorithm reads (preflight: the configured rewards store them)."""
        return self.advantage_scores()

    def prepare_update(self, batch) -> dict[str, float]:
        """Called once per update, before its first step, with every row of the iteration's batch
        (each trainer rank alike); returns metrics to log."""
        return {}

    #: run.staleness_weight_cap applies: the loss weighs each transition by its behaviour weight
    #: (`set_behaviour_weights`, engines/proximal.py)
    behaviour_weighted: bool = False
    _behaviour_weights: dict[str, np.ndarray] | None = None

    def set_behaviour_weights(self, weights: dict[str, np.ndarray] | None) -> None:
        """The update's truncated importance weights π_prox/π_behav per row (sample id → [S]), or
        None: unweighted. Set before each update's first step; rows absent weigh 1 (a sharded
        rank's padding, which is discarded)."""
        self._behaviour_weights = weights

    def proximal_columns(self, batch, policy) -> dict[str, np.ndarray]:
        """run.staleness > 0: the micro-batch's stored columns that hold the sampling policy's
        log-probs (and step means), recomputed under `policy` — the update's weights before its
        first optimizer step — in the stored dtype; {} for an algorithm whose loss takes no ratio
        to the sampling policy (it trains on older samples as they are)."""
        return {}

    # --- the rollout the algorithm trains on ---------------------------------------------------
    def check_family(self, family, model=None) -> None:
        """Refuse, before a run starts, a model family (and its model config section, `model`)
        this algorithm cannot train (ValueError naming why and the fix); every family it can step
        by default."""

    def check_rewards(self, rewards) -> None:
        """Refuse, before a run starts, a reward set (RewardSet) this algorithm's loss cannot use."""

    def check_prompt_meta(self, metas: list[dict]) -> None:
        """Refuse, before a run starts, training prompts whose metadata the loss cannot use (a
        multi-teacher distillation's task without a teacher)."""

    def bind_rewards(self, rewards) -> None:
        """The run's RewardSet, given by the engine that builds the algorithm: for a loss that
        scores its own images (the reward gradients of srpo, draft and refl); ignored by the others."""

    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        """Refuse sampling settings this algorithm cannot train on: a ValueError naming the fix
        (preflight turns it into a clear error before any work)."""

    def rollout_recipe(self, sampling: SamplingConfig, rng: np.random.Generator, step: str,
                       iteration: int) -> SamplerRecipe | TokenRecipe:
        """The sampler recipe of `iteration`'s rollouts (every round and row of it): which steps
        are stochastic, with which kernel, which transitions are stored. `rng` is the
        iteration's own (a pure function of the run seed and the iteration)."""
        return rollout_recipe(sampling, rng, step)

    def rollout_parts(self, sampling: SamplingConfig, rng: np.random.Generator, step: str,
                      iteration: int) -> list[SamplerRecipe | TokenRecipe]:
        """The iteration's rollouts in parts, each over every prompt of the iteration with its own
        recipe (one part by default: `rollout_recipe`). Each part gives each prompt a group of its
        own, sampled, planned into micro-batches and normalised on its own, so the rows of an
        iteration may store transitions at different steps (TempFlow-GRPO's branch steps)."""
        return [self.rollout_recipe(sampling, rng, step, iteration)]

    #: rollouts sample with the algorithm's own sampling policy (its state), not the published weights
    separate_sampler: bool = False
    #: rounds over an iteration's micro-batches, each with its own optimizer steps (and generator
    #: draws): online_sft's noise draws, one optimizer step each as flow_grpo's SFT takes them
    passes: int = 1

    def sampling_weights(self) -> dict[str, torch.Tensor] | None:
        """The trainable weights of the separate sampling policy, from the algorithm's state;
        None: not set yet (the published weights themselves, as at the start of a run)."""
        return None

    def set_sampling_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Start the sampling policy at these weights (the pre-update ones, when none is set)."""
        raise TypeError(f"algorithm {self.name!r} has no separate sampling policy")

    def frozen_slots(self) -> tuple[str, ...]:
        """Names of frozen policies the loss reads beside the trained one (ReplayPolicy.frozen):
        e.g. the update's starting weights (a ratio over several optimizer steps), an EMA anchor.
        Each is a copy of the module (made up front on a sharded trainer); none by default."""
        return ()

    def frozen_weights(self, name: str, start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The trainable weights of frozen policy `name` for this update; `start`: the update's
        starting weights (live tensors: copy them to keep them in the algorithm's state). None for
        a stored policy: the engine filled its slot from the stored source."""
        if name in self.stored_policies():
            return None
        raise TypeError(f"algorithm {self.name!r} declares no frozen policy {name!r}")

    def stored_policies(self) -> dict[str, str]:
        """Frozen slots (of `frozen_slots`) whose policy is stored outside the algorithm's state —
        a registered version (models:/NAME/VERSION) or a diffusers directory: DiffusionOPD's
        teacher. The stage layer resolves each, the engine loads it into the policy's slot before
        an update (engines/stored_policies.py); it never enters the student's checkpoints."""
        return {}

    def end_of_update(self, weights: dict[str, torch.Tensor], optimizer_steps: int) -> dict[str, float]:
        """Called once after an update with the new trainable weights and how many optimizer steps
        it took; returns metrics to log (e.g. the sampling policy's EMA decay)."""
        return {}

    #: advantages(rewards, group_ids, prompts=, history=) also takes each prompt's rewards from this
    #: run's earlier iterations (oldest first), which the stage reads from the trajectory store
    reward_history: bool = False

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        raise TypeError(f"algorithm {self.name!r} computes no rollout advantages (offline: {self.offline})")

    def trains_on(self, advantages: np.ndarray, group_ids: np.ndarray | None = None) -> np.ndarray:
        """Which samples enter the update (a boolean mask, from the stored advantages and group
        ids); all by default."""
        return np.ones(len(advantages), dtype=bool)

    @abstractmethod
    def losses(self, batch, policy: ReplayPolicy) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """Loss terms of one micro-batch (a RolloutBatch with the `needs` fields and `advantage`),
        each with its metrics; the trainer averages them over the optimizer step's terms."""

    def terms(self, batch, trained_steps: frozenset[int] | None = None) -> int:
        """How many loss terms `losses` yields for `batch` (the trainer's averaging divisor);
        `trained_steps`: the replay's (ReplayPolicy.trained_steps)."""
        return 1

    # --- training state of the algorithm itself (e.g. an adaptive coefficient) -----------------
    def after_optimizer_step(self, metrics: dict[str, float]) -> dict[str, float]:
        """Called after each optimizer step with that step's mean metrics; returns metrics to add."""
        return {}

    def state(self) -> dict | None:
        """State that evolves with training (saved with the optimizer state); None: stateless."""
        return None

    def load_state(self, state: dict | None) -> None:
        """Continue from `state` (None: the initial state of a fresh run or of base weights)."""



def _own_settings(model: type[BaseModel], name: str, values: dict) -> BaseModel:
    """The algorithm's settings from its keys of the `algorithm` section; a typo or a bad value
    names the key and the valid ones."""
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        shared = sorted(AlgorithmConfig.model_fields)
        own = sorted(model.model_fields)
        lines = []
        for err in exc.errors():
            key = "algorithm." + ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                hint = difflib.get_close_matches(str(err["loc"][-1]), own + shared, n=1)
                lines.append(f"unknown key {key!r} for algorithm {name!r}" + (f" (did you mean 'algorithm.{hint[0]}'?)"
                             if hint else "") + f"; its keys: {', '.join(own) or 'none'}; shared: {', '.join(shared)}")
            else:
                lines.append(f"{key}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def _builtin() -> None:
    from . import (awm, crd, dance_grpo, ddpo, dgpo, diffusion_dpo, diffusion_nft, diffusion_opd,  # noqa: F401
                   diffusion_sft, draft, flow_dppo, flow_grpo, gardo, grpo_guard, mix_grpo, online_dpo, online_sft, srpo,
                   tempflow_grpo, token_dpo, token_grpo, token_sft, v_grpo)  # (importing registers them)


ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm", "algorithms", _builtin)
register_algorithm = ALGORITHMS.register


def build_algorithm(cfg: AlgorithmConfig) -> Algorithm:
    """The algorithm `cfg.name` names, with its own settings validated from the section's keys."""
    return ALGORITHMS.get(cfg.name)(cfg)
