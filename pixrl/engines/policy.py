"""A loaded family plus what training adds: LoRA or full fine-tuning, the reference for KL,
and which checkpoint the in-memory weights currently are (so a stage loads weights only when
the requested policy version differs from what is already in memory)."""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from ..artifacts.checkpoints import (check_trained_part, has_ema, load_ema, load_optimizer_state, load_weights,
                                     read_counters)
from ..config.schema import ExperimentConfig
from ..models.registry import get_family
from ..stages.plan import seed_of
from .activation_checkpointing import enable_activation_checkpointing
from .adapters import adapters_off, add_lora
from .assets import resolve_model_path
from .ema import WeightAverage
from .fsdp import (align, fill_like, full, full_optimizer_state, like, materialize, shard_module,
                   sharded_optimizer_state, skeleton)
from .optimizers import apply_settings, build_optimizer, saved_state, split_saved_state

BASE = "base"
EMA_SUFFIX = "+ema"  # the in-memory weights are a checkpoint's weight average (load_version(ema=True))
log = logging.getLogger("pixrl.train")
ALGORITHM_STATE = "pixrl_algorithm"  # key of the algorithm's own state in the saved optimizer state


@contextmanager
def seeded(run_seed: int, device) -> Iterator[None]:
    """Random initialisation (LoRA's A matrices) drawn from the run seed, not from whatever the
    process's global generator holds: a resumed process, and every rank of a trainer group,
    build the same base adapter. The global generator's state is left as it was."""
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed_of(run_seed, 4))
        yield


def frozen_copy(module: torch.nn.Module, trained) -> torch.nn.Module:
    """A frozen copy of `module` that owns only its `trained` parameters; every other parameter
    (the base model under LoRA, a family's frozen parts) and buffer (SD3's 0.45 GiB positional
    table) is the module's own tensor, shared: it is the same in every copy, so a LoRA copy costs
    its adapter only (a whole copy of a 12B bf16 transformer is 24 GB; benchmarks/frozen_copies.py).
    Batch-norm statistics, which a forward in train mode updates in place, are copied."""
    owned = {id(p) for p in trained}
    shared = {id(p): p for p in module.parameters() if id(p) not in owned}
    shared.update({id(b): b for m in module.modules() if not isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                   for b in m.buffers(recurse=False)})
    held = copy.deepcopy(module, memo=shared)
    for p in held.parameters():
        if id(p) not in shared:
            p.requires_grad_(False)
    return held


class TrainablePolicy:
    def __init__(self, cfg: ExperimentConfig, trainable_device: str | None = None, text_towers: bool = True):
        """`trainable_device`: where the trained module is built when it is not `model.device` —
        "cpu" (host memory) or "meta" (no storage): a rank of a sharded group (`shard`).
        `text_towers=False`: a family with separate text encoders is loaded without them (a
        trainer rank, given the rollout's encodings)."""
        self.cfg = cfg
        fam_cls = get_family(cfg.model.family)
        self.family = fam_cls.load(resolve_model_path(cfg.model.path), dtype=cfg.model.dtype,
                                   device=cfg.model.device, max_sequence_length=cfg.model.max_sequence_length,
                                   resolution=cfg.model.size(),
                                   **({"frames": cfg.model.frames} if cfg.model.frames else {}),
                                   **({"trainable_device": trainable_device} if trainable_device else {}),
                                   **({} if text_towers else {"text_towers": False}),
                                   **cfg.model.family_options())
        if cfg.model.offload_text_encoders:
            self.family.offload_text_towers()
        self.module: torch.nn.Module = self.family.trainable_module()
        self.lora = cfg.algorithm.lora.enabled
        if self.lora:
            from peft import LoraConfig

            lc = cfg.algorithm.lora
            with seeded(cfg.run.seed, cfg.model.device):  # every process starts from the same adapter
                add_lora(self.module, LoraConfig(r=lc.rank, lora_alpha=lc.alpha, init_lora_weights=lc.init,
                                                 target_modules=list(self.family.lora_targets)))
        if cfg.model.gradient_checkpointing:
            enable_activation_checkpointing(self.family, self.module)
        self.module.requires_grad_(False)
        for p in self.trainable_parameters().values():
            p.requires_grad_(True)
        self._base_state = None if trainable_device else self._snapshot()  # sharded: taken by `shard`
        self._reference = None
        self._frozen: dict[str, torch.nn.Module] = {}  # frozen_view's copies, by slot
        self._explicit_reference = False
        self.weights_id = BASE
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizer_id: str | None = None
        self.optimizer_steps = 0  # the run's optimizer steps before the loaded state's next one (lr schedule)
        self.algorithm_state: dict | None = None  # the algorithm's own training state, beside the moments
        self.ema: WeightAverage | None = None  # algorithm.ema's average, loaded with the optimizer state
        self.sharded = False  # FSDP over a trainer group (shard)

    def shard(self, reference_copy: bool, frozen_slots: tuple[str, ...] = ()) -> None:
        """Shard the trained module over the process group (FSDP, engines/fsdp.py) from rank 0's
        weights: the other ranks may have built it on the meta device. The frozen copies an update
        uses beside it (a full fine-tune's KL reference, a separate sampling policy) are made now,
        as skeletons filled from the base weights' shards: a sharded module cannot be copied later.
        The base weights kept for `load_version(None)` are this rank's shards."""
        import torch.distributed as dist

        if self.weights_id != BASE:
            raise RuntimeError(f"shard a policy at its base weights (it holds {self.weights_id!r})")
        align(self.module, f"{self.family.name} trained module")
        rank0 = dist.get_rank() == 0
        source = dict(self.module.state_dict()) if rank0 else {}  # whole: taken before sharding
        slots = (["reference"] if reference_copy else []) + list(frozen_slots)
        copies = [skeleton(self.module).requires_grad_(False) for _ in slots]
        device = torch.device(self.cfg.model.device)
        units = getattr(self.family, "fsdp_units", None)
        for module in (self.module, *copies):
            shard_module(module, device.type, units)
        materialize(self.module, device, source)
        del source
        for module in copies:
            fill_like(module, self.module)
        made = dict(zip(slots, copies))
        self._reference = made.pop("reference", None)
        self._frozen = made
        self._base_state = self._snapshot()
        self.sharded = True

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.trainable_parameters().items()}

    def _copy(self, weights: dict[str, torch.Tensor], what: str) -> torch.nn.Module:
        module = frozen_copy(self.module, self.trainable_parameters().values())
        self._fill(module, weights, what)
        return module

    # --- trainable weights --------------------------------------------------------------------
    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        if self.lora:
            return {n: p for n, p in self.module.named_parameters() if "lora_" in n}
        frozen = tuple(getattr(self.family, "frozen_prefixes", ()))  # parts a family never trains
        return {n: p for n, p in self.module.named_parameters() if not (frozen and n.startswith(frozen))}

    def state(self) -> dict[str, torch.Tensor]:
        """The trainable tensors, whole (under FSDP a collective: every rank calls it)."""
        return {k: full(v.detach()) for k, v in self.trainable_parameters().items()}

    def _assign(self, weights: dict[str, torch.Tensor]) -> None:
        params = self.trainable_parameters()
        missing = set(params) - set(weights)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} trainable tensors, e.g. {sorted(missing)[:3]}; "
                             f"it was written for another model or LoRA setting")
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(like(weights[k], p))

    def load_version(self, checkpoint_dir: Path | None, checkpoint_id: str | None = None, ema: bool = False) -> None:
        """Make the in-memory weights those of a checkpoint (None = base weights); `ema`: its
        weight average (algorithm.ema) instead of its trained weights."""
        if checkpoint_dir is None:
            want, ema = BASE, False
        else:
            want = (checkpoint_id or read_counters(checkpoint_dir)["checkpoint_id"]) + (EMA_SUFFIX if ema else "")
        if self.weights_id == want:
            return
        if checkpoint_dir is not None:
            check_trained_part(checkpoint_dir, self.cfg.model.expert)
        if checkpoint_dir is None:
            self._assign(self._base_state)
        else:
            self._assign(load_ema(checkpoint_dir)[0] if ema else load_weights(checkpoint_dir))
        self.weights_id = want

    # --- optimizer ----------------------------------------------------------------------------
    def ensure_optimizer(self, checkpoint_dir: Path | None) -> torch.optim.Optimizer:
        """The configured optimizer (engines/optimizers.py) over the trainable weights, with the
        state saved alongside the current weights; `optimizer_steps`: the run's steps before it."""
        a = self.cfg.algorithm
        if self.optimizer is None:
            self.optimizer = build_optimizer(list(self.trainable_parameters().values()), a)
            self.optimizer_id = None  # no state yet: the block below sets it (and the weight average)
        if self.optimizer_id != self.weights_id:
            if checkpoint_dir is None:
                self.optimizer.state.clear()
                self.algorithm_state = None
                self.optimizer_steps = 0
            else:
                state = dict(load_optimizer_state(checkpoint_dir))
                self.algorithm_state = state.pop(ALGORITHM_STATE, None)
                state, self.optimizer_steps = split_saved_state(state, a)
                if self.sharded:
                    state = sharded_optimizer_state(state, list(self.trainable_parameters().values()))
                self.optimizer.load_state_dict(state)
            self.ema = self._weight_average(checkpoint_dir)
            self.optimizer_id = self.weights_id
        apply_settings(self.optimizer, a)  # the moments come from the checkpoint, the settings from this run's config
        return self.optimizer

    def _weight_average(self, checkpoint_dir: Path | None) -> WeightAverage | None:
        """algorithm.ema's average as of the weights the update starts from: the checkpoint's, or
        one that begins at those weights (a run's start; a checkpoint written without one)."""
        settings = self.cfg.algorithm.ema
        if not settings.enabled:
            return None
        params = self.trainable_parameters()
        if checkpoint_dir is not None and has_ema(checkpoint_dir):
            weights, steps = load_ema(checkpoint_dir)
            return WeightAverage.loaded(settings, weights, steps, params)
        if checkpoint_dir is not None:
            log.warning("checkpoint %s holds no weight average (written with algorithm.ema off): the average "
                        "begins at its weights", Path(checkpoint_dir).name)
        return WeightAverage.starting_at(settings, params)

    def optimizer_state(self, steps: int) -> dict:
        """The optimizer's state_dict in the single-process format (under FSDP, gathered whole),
        with its name and the run's optimizer steps after this update (`steps`)."""
        state = self.optimizer.state_dict()
        return saved_state(full_optimizer_state(state) if self.sharded else state, self.cfg.algorithm, steps)

    def invalidate(self) -> None:
        """The in-memory weights/optimizer match no checkpoint (e.g. an update failed mid-way)."""
        self.weights_id = "invalid"
        self.optimizer_id = "invalid"

    def mark(self, checkpoint_id: str) -> None:
        """The in-memory weights and optimizer now equal this (just written) checkpoint."""
        self.weights_id = checkpoint_id
        self.optimizer_id = checkpoint_id

    # --- KL reference -------------------------------------------------------------------------
    def reference(self) -> "_ReferenceView":
        """A velocity model for the reference policy, usable wherever the family is."""
        return _ReferenceView(self)

    def set_reference(self, weights: dict[str, torch.Tensor]) -> None:
        """Use a frozen copy with these trainable weights (e.g. a registered checkpoint) as the
        reference instead of the base model."""
        if self.sharded and self._reference is None:
            raise RuntimeError("a sharded trainer has no reference copy: it is made when the group shards "
                               "(LocalEngine.shard), for algorithms that need a reference")
        if self._reference is not None:  # refill the copy (made before sharding, or by an earlier call)
            self._fill(self._reference, weights, "reference checkpoint")
        else:
            self._reference = self._copy(weights, "reference checkpoint")
        self._explicit_reference = True

    def use_base_reference(self) -> None:
        """The base model as the reference again, after set_reference chose other weights."""
        if not self._explicit_reference:
            return
        self._explicit_reference = False
        if self._reference is not None and not self.lora:  # a full fine-tune's copy: refilled with the base
            self._fill(self._reference, self._base_state, "base weights")

    def set_frozen_module(self, slot: str, module: torch.nn.Module) -> None:
        """Put a whole module of its own in `slot` — a directory teacher: another checkpoint of the
        same architecture, not the trained module with other trained tensors; `frozen_view(None,
        slot)` then computes with it as it is."""
        if self.sharded:
            raise RuntimeError(f"a sharded trainer holds its {slot!r} copy as shards of the trained module; a module "
                               f"of its own cannot take its place")
        self._frozen[slot] = module

    def frozen_view(self, weights: dict[str, torch.Tensor] | None, slot: str = "sampler") -> "_FrozenView":
        """A velocity model with these trainable weights, frozen, beside the trained one (e.g.
        DiffusionNFT's sampling policy, AWM's EMA anchor). One copy of the module per slot is kept
        and refilled per call: a slot's earlier view takes the new weights too. `weights` None:
        the slot's module as it is (`set_frozen_module`)."""
        if weights is None:
            if slot not in self._frozen:
                raise RuntimeError(f"the {slot!r} slot holds nothing: a stored policy is put there by the engine "
                                   f"before an update (Engine.train(stored=...)), and no weights were given")
            return _FrozenView(self, self._frozen[slot])
        if slot not in self._frozen:
            if self.sharded:
                raise RuntimeError(f"a sharded trainer has no {slot!r} copy: the frozen copies are made when the "
                                   "group shards (LocalEngine.shard), for the slots the algorithm declares")
            self._frozen[slot] = self._copy(weights, f"{slot} weights")
        else:
            self._fill(self._frozen[slot], weights, f"{slot} weights")
        return _FrozenView(self, self._frozen[slot])

    def _fill(self, module: torch.nn.Module, weights: dict[str, torch.Tensor], what: str) -> None:
        """Copy `weights` into a copy of the module's trainable tensors; all of them must be there."""
        missing = set(self.trainable_parameters()) - set(weights)
        if missing:
            raise ValueError(f"{what} lack(s) {len(missing)} trainable tensors, e.g. {sorted(missing)[:3]}")
        params = dict(module.named_parameters())
        with torch.no_grad():
            for k in self.trainable_parameters():
                params[k].copy_(like(weights[k], params[k]))

    def module_call(self, module: torch.nn.Module, method: str, *args, **kwargs) -> torch.Tensor:
        """A family method computed with `module` in place of the trained one, without gradient."""
        with torch.no_grad():
            live = self.family.transformer
            self.family.transformer = module
            try:
                return getattr(self.family, method)(*args, **kwargs)
            finally:
                self.family.transformer = live

    def reference_call(self, method: str, *args, **kwargs) -> torch.Tensor:
        """A family method (`velocity`, `sequence_logits`) under the reference policy: adapters
        disabled (LoRA) or a frozen base copy, unless set_reference chose a checkpoint."""
        with torch.no_grad():
            if self.lora and not self._explicit_reference:
                with adapters_off(self.module):
                    return getattr(self.family, method)(*args, **kwargs)
            if self._reference is None:
                self._reference = self._copy(self._base_state, "base weights")
        return self.module_call(self._reference, method, *args, **kwargs)


class _ReferenceView:
    """The reference policy wherever the family is used: its model calls, the family's facts."""

    def __init__(self, policy: TrainablePolicy):
        self._policy = policy
        self.dtype = policy.family.dtype

    def __getattr__(self, name: str):  # schedule, latent_shape, scheduler: the family's own
        return getattr(self._policy.family, name)

    def velocity(self, *args, **kwargs) -> torch.Tensor:
        return self._policy.reference_call("velocity", *args, **kwargs)

    def sequence_logits(self, *args, **kwargs) -> torch.Tensor:
        return self._policy.reference_call("sequence_logits", *args, **kwargs)


class _FrozenView:
    """A frozen copy of the trained module with other weights, wherever the family is used."""

    def __init__(self, policy: TrainablePolicy, module: torch.nn.Module):
        self._policy, self._module = policy, module
        self.dtype = policy.family.dtype

    def __getattr__(self, name: str):
        return getattr(self._policy.family, name)

    def velocity(self, *args, **kwargs) -> torch.Tensor:
        return self._policy.module_call(self._module, "velocity", *args, **kwargs)
