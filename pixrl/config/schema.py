"""Typed experiment config. Every section forbids unknown keys, so a typo fails before any
model loads, with the valid keys listed (see loader.format_validation_error)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .model import AudioVideoGuidance, ModelConfig  # noqa: F401 - the config's home
from .sampling import T2I_R1_REASONING_PROMPT, SamplingConfig, _Section  # noqa: F401 - the config's home


class LoraConfig(_Section):
    enabled: bool = False
    rank: int = Field(32, ge=1)
    alpha: float = 64.0
    init: str = "gaussian"


class EmaConfig(_Section):
    """A moving average of the trainable weights, kept beside them in every checkpoint and used
    where a version is evaluated or exported; rollouts and updates use the trained weights. After
    the run's optimizer step n: when (n + 1) % every == 0, ema += (1 − d)(θ − ema), d =
    min((1 + n)/(10 + n), decay) — flow_grpo's `train.ema` (decay 0.9, every 8; algorithms.md §2.6)."""

    enabled: bool = False
    decay: float = Field(0.9, gt=0, lt=1)
    every: int = Field(8, ge=1, description="update the average after every this many optimizer steps")
    per_micro_batch: bool = Field(False, description="flow_grpo's count: it steps the average once per training "
                                  "micro-batch with the optimizer-step count, i.e. k times at a due step of k "
                                  "micro-batches (decay d^k); false: once per optimizer step")


class AlgorithmConfig(BaseModel):
    """What every algorithm shares (which one, the optimizer, LoRA). The algorithm's own settings
    (Flow-GRPO's clip range, β, …) are further keys of this section, validated by that
    algorithm's settings model (`Algorithm.Settings`) when it is built — in preflight, before
    anything is written — so adding an algorithm never touches this schema."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    name: str = Field("flow_grpo", description="registered algorithm (pixrl.algorithms.base)")
    train_cfg: bool = Field(True, description="replay with the rollout's classifier-free guidance")
    optimizer: Literal["adamw", "adafactor"] = Field(
        "adamw", description="adamw (every seed's), or adafactor: transformers' Adafactor as DiffusionDPO trains "
        "SDXL — factored second moments, no first moment, update clipping at RMS 1 — a few MB of state where "
        "AdamW keeps two copies of the weights (engines/optimizers.py); adam_betas and adam_eps are AdamW's")
    lr: float = Field(1e-4, gt=0)
    lr_warmup_steps: int = Field(0, ge=0, description="constant learning rate after a linear warmup over this many "
                                 "optimizer steps of the run (diffusers' constant_with_warmup: step s < W uses "
                                 "lr·s/W); 0: constant")
    weight_decay: float = 1e-4
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    max_grad_norm: float = Field(1.0, gt=0)
    optimizer_steps_per_iteration: int = Field(2, ge=1, description="the batch is split into this many accumulation groups")
    lora: LoraConfig = LoraConfig()
    ema: EmaConfig = EmaConfig()


class RewardConfig(_Section):
    weights: dict[str, float] = Field(default_factory=lambda: {"shapes": 1.0})
    aggregate: Literal["reward", "advantage"] = Field(
        "reward", description="several rewards: advantages of the weighted total ('reward'), or each reward's "
                              "group advantage weighted and summed ('advantage', MixGRPO's advantage_aggr)")
    advantage_weights: dict[str, float] | None = Field(
        None, description="reward.aggregate=advantage: the stored scores normalised apart and their weights — any "
        "reward's own or one of the components it stores (videoalign.vq, videoalign.mq: DanceGRPO's vq_coef and "
        "mq_coef; editreward.following, editreward.quality); None: reward.weights")
    options: dict[str, dict] = Field(default_factory=dict, description="per-reward constructor options")
    tasks: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="per-task rewards: a task (the prompt metadata field route_by) → its "
        "weights {reward: weight}; a prompt whose task is not a key is scored by reward.weights, and a sample "
        "stores only its task's scores (rewards/routing.py)")
    route_by: str = Field("category", description="reward.tasks: the prompt metadata field that names a prompt's task")
    overlap: bool = Field(False, description="decode and score each generated micro-batch in a background thread "
                                             "while the next one generates (local engine); decode and score then "
                                             "run per micro-batch, prefetched or not, so results do not depend on it")

    @model_validator(mode="after")
    def _nonempty(self) -> RewardConfig:
        if not self.weights:
            raise ValueError("reward.weights is empty; name at least one reward, e.g. reward.weights={shapes: 1.0}")
        if self.advantage_weights is not None and self.aggregate != "advantage":
            raise ValueError("reward.advantage_weights weighs advantages normalised apart; set reward.aggregate=advantage "
                             "(or unset reward.advantage_weights)")
        if self.advantage_weights == {}:
            raise ValueError("reward.advantage_weights is empty; name at least one stored score, or unset it")
        empty = [t for t, w in self.tasks.items() if not w]
        if empty:
            raise ValueError(f"reward.tasks[{empty[0]!r}] is empty; give the task at least one reward, e.g. "
                             f"reward.tasks={{{empty[0]}: {{shapes: 1.0}}}}, or drop the key")
        if self.tasks and self.aggregate == "advantage":
            raise ValueError("reward.tasks with reward.aggregate=advantage is not supported: each task scores its own "
                             "rewards, and advantages normalised per reward need every sample to store them; use "
                             "reward.aggregate=reward (each task's weighted total, normalised in its group)")
        return self

    def advantage_parts(self) -> dict[str, float] | None:
        """The scores reward.aggregate=advantage normalises apart, with their weights; None: the
        total's advantage (aggregate=reward, or one reward without advantage_weights)."""
        if self.aggregate != "advantage":
            return None
        if self.advantage_weights is not None:
            return dict(self.advantage_weights)
        return dict(self.weights) if len(self.weights) > 1 else None


class DatasetConfig(_Section):
    name: str = "shapes"
    path: str = "builtin:shapes/prompts_train.parquet"  # parquet/text file of prompts, or builtin:
    heldout_path: str | None = "builtin:shapes/prompts_heldout.parquet"
    categories: list[str] | None = Field(None, description="train only on prompts of these categories (prompt "
                                                           "metadata 'category'); held-out evaluation still "
                                                           "covers every category")


STAGES = ("generate", "decode", "score", "replay", "update", "publish")


class TaskRetry(_Section):
    """Retries of one stage task for transient faults only (connection, timeout, busy file)."""

    retries: int = Field(2, ge=0, description="extra attempts after the first")
    delay_s: float = Field(1.0, ge=0, description="wait before the first retry")
    backoff: float = Field(2.0, ge=1.0, description="each further wait is this many times longer")
    jitter: float | None = Field(0.5, ge=0, description="Prefect retry_jitter_factor (None: exact delays)")


def _default_retries() -> dict[str, TaskRetry]:
    return {s: TaskRetry(retries=3 if s in ("score", "publish") else 2) for s in STAGES}


class RetentionConfig(_Section):
    """Which of a run's checkpoints stay on disk (applied at each publish by
    pixrl.artifacts.retention; a checkpoint is stored once, where its registered version points).
    The ladder, newest first: the newest `keep_full` stay whole (resume; replay and forks of the
    last iterations need their optimizer state); older ones of every `weights_every`-th iteration
    (the weights after N, 2N, … updates) keep their weights only; evaluated versions
    (`keep_evaluated`) and versions holding an alias stay whole; every other one is deleted and
    its registered version tagged `pixrl.pruned`."""

    keep_full: int | None = Field(3, ge=1, description="newest N checkpoints kept whole (weights + optimizer + "
                                                        "RNG state); null: keep every checkpoint whole")
    weights_every: int = Field(10, ge=0, description="an older checkpoint whose iteration+1 is a multiple of N "
                                                     "keeps its weights (optimizer state deleted); 0: none")
    keep_evaluated: bool = Field(True, description="versions evaluated on the held-out set (heldout_accuracy) "
                                                   "stay whole; aliased versions always do")


class ProfileConfig(_Section):
    """torch.profiler over chosen iterations' stages (the local engine's compute): a Chrome trace
    and the operators with the most self time, kept with the run's records and logged to its
    MLflow run under profile/it_<N>/<stage>/ (stages/profiling.py)."""

    iterations: list[int] = Field(default_factory=list, description="iterations whose stages are profiled")
    stages: list[str] = Field(default_factory=lambda: ["generate", "update"], description="which of their stages")
    rows: int = Field(30, ge=1, description="operators in the summary table")

    @model_validator(mode="after")
    def _known(self) -> "ProfileConfig":
        unknown = sorted(set(self.stages) - set(STAGES))
        if unknown:
            raise ValueError(f"run.profile.stages has unknown stage(s) {unknown}; stages are {', '.join(STAGES)}")
        return self


class RunConfig(_Section):
    name: str = "default"
    engine: Literal["local", "ray"] = Field("local", description="where the compute runs: this process, or Ray "
                                                                  "workers (settings under `ray`); the stage layer "
                                                                  "is the same for every engine")
    iterations: int = Field(40, ge=1)
    staleness: int = Field(0, ge=0, le=4, description="iteration i samples with the policy of iteration i − N "
                           "(the weights N updates behind the update's): 0 on-policy; 1 one-step-off, the next "
                           "rollout runs on the Ray engine's rollout workers while this update trains. Log-prob "
                           "algorithms recompute the old log-probs under the update's weights (stages/schedule.py)")
    staleness_weight_cap: float | None = Field(
        None, gt=1.0, description="run.staleness ≥ 1: each transition's loss weighted by min(π_prox/π_behav, cap) — "
        "decoupled PPO's truncated importance weight from the update's starting policy back to the one that "
        "sampled the row (Flow-GRPO and its kin); None: unweighted, as verl's and MM-GRPO's one-step-off trainers")
    time_budget_minutes: float | None = Field(None, gt=0, description="stop starting iterations once this process has "
                                              "trained this long (wall clock; the run then ends normally, evaluated "
                                              "after its last iteration); None: run.iterations decides")
    seed: int = 0
    workdir: str = "work"
    store_root: str | None = None  # Lance root; default <workdir>/lance (local path or object-store URI)
    tracking_uri: str | None = None  # default sqlite:///<workdir>/mlflow.db
    experiment: str = "pixrl"
    threads: int | None = None
    eval_every: int = Field(0, ge=0, description="held-out evaluation every N iterations (0: off); best → alias champion")
    eval_per_category: int = Field(24, ge=1, description="held-out samples per prompt category")
    eval_trained: bool = Field(False, description="with algorithm.ema: also evaluate each version's trained weights "
                               "(heldout_trained/*) beside its average (heldout/*)")
    retention: RetentionConfig = RetentionConfig()
    profile: ProfileConfig = ProfileConfig()
    keep_checkpoints: int | None = Field(None, ge=1, description="deprecated alias of run.retention.keep_full")
    retries: dict[str, TaskRetry] = Field(default_factory=_default_retries,
                                          description="per stage task; only transient faults are retried")

    @model_validator(mode="before")
    @classmethod
    def _keep_checkpoints_alias(cls, data):
        """run.keep_checkpoints=N (deprecated) means run.retention.keep_full=N; both set must agree."""
        if not isinstance(data, dict) or data.get("keep_checkpoints") is None:
            return data
        keep, ret = data["keep_checkpoints"], data.get("retention")
        ret = ret.model_dump(exclude_unset=True) if isinstance(ret, BaseModel) else dict(ret or {})
        if ret.get("keep_full", keep) != keep:
            raise ValueError(f"run.keep_checkpoints={keep} (deprecated alias of run.retention.keep_full) disagrees "
                             f"with run.retention.keep_full={ret['keep_full']}; set only run.retention.keep_full "
                             f"(and run.keep_checkpoints=null)")
        return {**data, "retention": RetentionConfig.model_validate({**ret, "keep_full": keep})}

    @model_validator(mode="after")
    def _known_stages(self) -> RunConfig:
        unknown = sorted(set(self.retries) - set(STAGES))
        if unknown:
            raise ValueError(f"run.retries has unknown stage(s) {unknown}; stages are {', '.join(STAGES)}")
        for stage, default in _default_retries().items():  # a partial override keeps the other stages' defaults
            self.retries.setdefault(stage, default)
        return self


class WorkerResources(_Section):
    """What one Ray worker of a kind reserves (Ray's logical resources)."""

    num_cpus: float = Field(1, ge=0)
    num_gpus: float = Field(0, ge=0, description="1: the worker owns a GPU (its model goes to cuda)")
    resources: dict[str, float] = Field(default_factory=dict, description="custom resources, e.g. {node_a: 1}")


class RayConfig(_Section):
    """The Ray engine (`run.engine=ray`): where the cluster is and its worker pools."""

    address: str = Field("", description="'' starts a local Ray for this run; 'auto' joins the cluster this node "
                                         "belongs to (`ray start`); 'HOST:PORT' a cluster's GCS; "
                                         "'ray://HOST:10001' through the Ray client")
    rollout_workers: int = Field(2, ge=1, description="actors that generate (and decode, and evaluate)")
    reward_workers: int = Field(1, ge=1, description="actors that score (model-based rewards load once per actor)")
    trainer_workers: int = Field(2, ge=1, description="ranks of the update's torch.distributed group")
    trainer_sharding: Literal["ddp", "fsdp"] = Field("ddp", description="ddp: every rank holds the whole model and "
                                                                          "the gradients are all-reduced; fsdp: weights, "
                                                                          "gradients and Adam moments sharded over the "
                                                                          "ranks (torch fully_shard), for a model whose "
                                                                          "training state does not fit one device")
    rollout: WorkerResources = WorkerResources()
    reward: WorkerResources = WorkerResources()
    trainer: WorkerResources = WorkerResources()
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="the trainer group's torch.distributed "
                                                                          "backend; auto: nccl on GPU, gloo on CPU")
    num_cpus: int | None = Field(None, ge=1, description="a local Ray's logical CPUs; None: what the workers reserve "
                                                         "(at least this machine's cores)")
    object_store_mb: int = Field(512, ge=64, description="a local Ray's object store")
    max_restarts: int = Field(3, ge=0, description="times a dead worker is restarted; the stage's task retry then "
                                                   "reruns its call on the restarted worker")
    connect_timeout_s: float = Field(10.0, gt=0, description="how long reaching `address` may take before the "
                                                             "run stops, naming it")
    runtime_env: dict = Field(default_factory=dict, description="Ray runtime_env for every worker (env_vars, "
                                                                "py_executable, working_dir, …)")


class DPOConfig(_Section):
    """Offline Diffusion-DPO over archived rollouts (`pixrl dpo`): where the pairs come from and
    how they are formed. The loss (β, σ sampling), optimizer and LoRA are in `algorithm`."""

    source: list[str] = Field(default_factory=list, description="run names, experiment:NAME, or TABLE.lance[@version]")
    iteration_range: tuple[int, int] | None = Field(None, description="source iterations [lo, hi)")
    policy_versions: list[int] | None = Field(None, description="only rollouts of these policy versions")
    reward_min: dict[str, float] = Field(default_factory=dict, description="'reward' or a component → minimum")
    reward_max: dict[str, float] = Field(default_factory=dict, description="'reward' or a component → maximum")
    categories: list[str] | None = Field(None, description="prompt categories (prompt_meta.category)")
    pairing: Literal["best_worst", "all"] = "best_worst"
    pair_on: str = Field("reward", description="what ranks a group: 'reward' (the total) or a reward component, "
                                                "e.g. 'shapes.correct' to pair exactly-right against wrong")
    margin: float = Field(0.0, ge=0, description="minimum pair_on difference of a pair (ties are always dropped)")
    balance: Literal["none", "category"] = Field("none", description="'category': every step draws pairs from the "
                                                 "prompt categories in turn, so no category's pairs drown the others")
    steps: int = Field(200, ge=1, description="optimizer steps")
    pairs_per_step: int = Field(32, ge=1)
    reference: str = Field("base", description="'base' (adapters off / base weights) or models:/NAME/VERSION")
    init: str = Field("base", description="starting policy: 'base' or models:/NAME/VERSION")
    eval_per_category: int = Field(48, ge=1)


DPO_LOSS_KEYS = ("beta", "timesteps", "logit_mean", "logit_std")


class ExperimentConfig(_Section):
    model: ModelConfig = ModelConfig()
    sampling: SamplingConfig = SamplingConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    reward: RewardConfig = RewardConfig()
    dataset: DatasetConfig = DatasetConfig()
    run: RunConfig = RunConfig()
    ray: RayConfig = RayConfig()
    dpo: DPOConfig | None = None  # set by the offline DPO experiments only

    @model_validator(mode="before")
    @classmethod
    def _dpo_loss_keys_moved(cls, data):
        """dpo.beta / timesteps / logit_mean / logit_std (where configs before the algorithm
        registry kept Diffusion-DPO's loss) are read as algorithm.*; both set must agree."""
        if not isinstance(data, dict) or not isinstance(data.get("dpo"), dict):
            return data
        moved = {k: data["dpo"][k] for k in DPO_LOSS_KEYS if k in data["dpo"]}
        if not moved:
            return data
        algo = data.get("algorithm")
        algo = algo.model_dump(exclude_unset=True) if isinstance(algo, BaseModel) else dict(algo or {})
        for k, v in moved.items():
            if k in algo and algo[k] != v:
                raise ValueError(f"dpo.{k}={v} (the old place of Diffusion-DPO's {k}) disagrees with "
                                 f"algorithm.{k}={algo[k]}; set only algorithm.{k}")
        return {**data, "dpo": {k: v for k, v in data["dpo"].items() if k not in moved},
                "algorithm": {**algo, **moved}}

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentConfig:
        n = self.sampling.group_size * self.sampling.prompts_per_iteration
        if n % self.sampling.micro_batch:
            raise ValueError(f"sampling.micro_batch={self.sampling.micro_batch} must divide group_size × "
                             f"prompts_per_iteration = {n}")
        if self.run.profile.iterations and self.run.engine != "local":
            raise ValueError(f"run.profile traces the compute of this process, and run.engine={self.run.engine} "
                             f"computes in its workers — profile with run.engine=local, or set "
                             f"run.profile.iterations=[]")
        if self.reward.overlap and self.run.engine != "local":
            raise ValueError(f"reward.overlap=true overlaps scoring with rollout inside the local engine; "
                             f"run.engine={self.run.engine} scores on its own reward workers — set "
                             f"reward.overlap=false")
        if self.run.staleness_weight_cap is not None and not self.run.staleness:
            raise ValueError(f"run.staleness_weight_cap={self.run.staleness_weight_cap} weighs rows an older policy "
                             f"sampled, and run.staleness=0 samples with the update's own: set run.staleness >= 1 "
                             f"or unset run.staleness_weight_cap")
        keep = self.run.retention.keep_full
        if self.run.staleness and keep is not None and keep < self.run.staleness + 1:
            raise ValueError(f"run.staleness={self.run.staleness} samples with the checkpoint {self.run.staleness} "
                             f"iteration(s) behind the newest, and resume needs it whole: run.retention.keep_full={keep} "
                             f"keeps fewer — set run.retention.keep_full >= {self.run.staleness + 1}")
        if self.algorithm.optimizer == "adafactor" and self.run.engine == "ray" and self.ray.trainer_sharding == "fsdp":
            raise ValueError("algorithm.optimizer=adafactor keeps factored moments that FSDP's sharded parameters do "
                             "not lay out; with ray.trainer_sharding=fsdp set algorithm.optimizer=adamw (its moments "
                             "are sharded), or use ray.trainer_sharding=ddp")
        return self
