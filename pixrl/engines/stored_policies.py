"""The algorithm's stored policies (`Algorithm.stored_policies`: DiffusionOPD's teacher) as an
engine holds them, loaded once per checkpoint. Two kinds:

- a pixrl checkpoint (a registered version): its trained tensors, checked against the tensors this
  policy trains — a LoRA teacher of another rank or target set, or a full fine-tune's weights
  beside a LoRA student, would load into the wrong places or fail mid-update — filled into the
  slot's frozen copy of the trained module (under LoRA: the adapter's cost);
- a diffusers directory of the same architecture (a merged fine-tune, another framework's
  output): the trained component loaded whole, as a module of its own in the slot (its own
  memory; not on a sharded trainer).

A slot is filled when its source or the policy object changes, not per update: the algorithm's
`frozen_weights` gives None for a stored slot, and the replay uses the slot as it is."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import torch

from ..artifacts.checkpoints import CONFIG, COUNTERS, load_weights
from .base import PolicySource


def is_checkpoint(path: Path) -> bool:
    """A pixrl checkpoint directory (else: a diffusers directory)."""
    return (Path(path) / COUNTERS).is_file()


def component_dir(path: Path, component: str) -> Path:
    """The trained component's directory: `component/` of a pipeline directory, or the directory
    itself when it is the component's (its config.json names a class)."""
    path = Path(path)
    if (path / component / "config.json").is_file():
        return path / component
    if (path / "config.json").is_file() and "_class_name" in json.loads((path / "config.json").read_text()):
        return path
    raise FileNotFoundError(f"{path}: neither a pixrl checkpoint, a diffusers pipeline directory with "
                            f"{component}/config.json, nor a {component} directory with its config.json")


def check_same_architecture(theirs_dir: Path, mine_dir: Path, what: str) -> None:
    """The two component directories' configs describe one architecture (class and every setting)."""
    theirs, mine = (json.loads((Path(d) / "config.json").read_text()) for d in (theirs_dir, mine_dir))
    keys = sorted(k for k in set(theirs) | set(mine) if not k.startswith("_") or k == "_class_name")
    differ = [k for k in keys if theirs.get(k) != mine.get(k)]
    if differ:
        k = differ[0]
        raise ValueError(f"{what} is another architecture than this run's model: {k}={theirs.get(k)!r} against "
                         f"{mine.get(k)!r}" + (f" (and {len(differ) - 1} more settings)" if len(differ) > 1 else "")
                         + " — a teacher must be a checkpoint of the same model")


def check_same_tensors(weights: dict[str, torch.Tensor], trainable: dict[str, torch.Tensor], what: str) -> None:
    """`weights` are of the tensors this policy trains, by name and shape, or a ValueError naming
    the difference and the fix."""
    mine = {k: tuple(v.shape) for k, v in trainable.items()}
    theirs = {k: tuple(v.shape) for k, v in weights.items()}
    if mine == theirs:
        return
    absent, other = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    reshaped = sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])
    parts = [f"{len(absent)} of this policy's {len(mine)} trained tensors absent (e.g. {absent[0]})" if absent else "",
             f"{len(other)} it does not train (e.g. {other[0]})" if other else "",
             f"{len(reshaped)} of other shapes (e.g. {reshaped[0]}: {theirs[reshaped[0]]} vs {mine[reshaped[0]]})"
             if reshaped else ""]
    raise ValueError(f"{what} holds other trained tensors than this run's policy: "
                     f"{'; '.join(p for p in parts if p)} — it must have been trained with this run's "
                     f"algorithm.lora settings (enabled, rank, target modules) and model.expert")


def check_trained_alike(ckpt_dir: Path, cfg, what: str) -> None:
    """The checkpoint was trained as this run trains — the same family, expert and adapter
    (LoRA on/off, rank, alpha): its tensors load into this policy's frozen copy and mean there
    what they meant when trained. Checkpoints without a stored config pass (the engine still
    checks names and shapes)."""
    f = Path(ckpt_dir) / CONFIG
    if not f.is_file():
        return
    theirs = json.loads(f.read_text())
    lora_t, lora_m = (theirs.get("algorithm") or {}).get("lora") or {}, cfg.algorithm.lora
    pairs = [("model.family", (theirs.get("model") or {}).get("family"), cfg.model.family),
             ("model.expert", (theirs.get("model") or {}).get("expert"), cfg.model.expert),
             ("algorithm.lora.enabled", bool(lora_t.get("enabled", False)), lora_m.enabled)]
    if lora_m.enabled and lora_t.get("enabled"):
        pairs += [("algorithm.lora.rank", lora_t.get("rank"), lora_m.rank),
                  ("algorithm.lora.alpha", float(lora_t.get("alpha", 0)), float(lora_m.alpha))]
    for key, t, m in pairs:
        if t != m:
            raise ValueError(f"{what} was trained with {key}={t}; this run has {key}={m} — a stored policy "
                             f"loads into this policy's frozen copy, so set {key}={t} or name a version "
                             f"trained with {key}={m}")


def load_component(directory: Path, dtype: torch.dtype, device) -> torch.nn.Module:
    """A diffusers model directory as a frozen module on `device` in `dtype`."""
    import diffusers

    name = json.loads((Path(directory) / "config.json").read_text())["_class_name"]
    module = getattr(diffusers, name).from_pretrained(str(directory), torch_dtype=dtype)
    return module.to(device).eval().requires_grad_(False)


class StoredPolicies:
    """Loaded stored policies by slot, reloaded only when a slot's source changes."""

    def __init__(self):
        self._held: dict[str, tuple[tuple, dict | None, torch.nn.Module | None]] = {}
        self._filled: dict[str, tuple[weakref.ref, tuple]] = {}  # slot → (the policy, the source) it holds

    def give(self, algorithm, stored: dict[str, PolicySource], policy, cfg) -> None:
        """Load each slot's source (once) and put it in the policy's slot: a checkpoint's weights
        into the slot's frozen copy, a directory's module as the slot."""
        wanted = algorithm.stored_policies()
        if set(stored) != set(wanted):
            raise ValueError(f"algorithm {algorithm.name!r} reads the stored policies {sorted(wanted)}; the update "
                             f"was given {sorted(stored)}")
        for name, src in stored.items():
            what = f"{name} {wanted[name]}"
            if src.checkpoint_dir is None:
                raise ValueError(f"{what}: the base weights are not a stored policy — name a trained version")
            key = (str(Path(src.checkpoint_dir).resolve()), src.checkpoint_id)
            if name not in self._held or self._held[name][0] != key:
                self._held[name] = (key, *self._load(Path(src.checkpoint_dir), policy, cfg, what))
            filled = self._filled.get(name)
            if filled is None or filled[0]() is not policy or filled[1] != key:
                _, weights, module = self._held[name]
                if module is not None:
                    policy.set_frozen_module(name, module)
                else:
                    policy.frozen_view(weights, slot=name)  # fills the slot's copy (made now, or at shard time)
                self._filled[name] = (weakref.ref(policy), key)

    @staticmethod
    def _load(path: Path, policy, cfg, what: str) -> tuple[dict | None, torch.nn.Module | None]:
        if is_checkpoint(path):
            check_trained_alike(path, cfg, what)  # also a version downloaded from MLflow's artifacts
            weights = load_weights(path)
            check_same_tensors(weights, policy.trainable_parameters(), what)
            return weights, None
        if policy.sharded:
            raise ValueError(f"{what}: a diffusers directory is loaded as a whole module of its own, which a sharded "
                             f"(FSDP) trainer does not hold; train with ray.trainer_sharding=none, or name a "
                             f"registered version trained with this run's settings")
        fam = policy.family
        component = type(fam).trained_component(cfg.model.family_options())
        return None, load_component(component_dir(path, component), fam.dtype, fam.device)
