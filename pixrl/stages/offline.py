"""The offline stage layer (`pixrl dpo`): select archived rollouts, pair them, train the
registered offline algorithm (Diffusion-DPO) through the engine, publish, evaluate.

Each stage first checks whether its output is stored (a rerun of the flow resumes), writes once
and logs its metrics. Artifacts:
- `<store_root>/<run>/<run_id>/selection.lance`: the selected rows' keys, prompts and rewards;
- `<store_root>/<run>/<run_id>/pairs.lance`: winner/loser keys per pair, with rewards and margin;
- `checkpoints/<run>/<run_id>/dpo_final`: the trained weights (the online loop's format),
  registered as a version of the experiment's `<experiment>-policy` (alias `rollout`).
Latents are never copied: update reads them by key from the pinned source versions.
"""

from __future__ import annotations

import json
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

from ..algorithms.pairing import make_pairs, pair_order
from ..algorithms.recipe import stored_recipe
from ..algorithms.sampling import SamplerRecipe
from ..artifacts.archive import PinnedTable, component_values, select_rows
from ..artifacts.batch import DECODE_INPUT, RolloutBatch, missing_fields
from ..artifacts.checkpoints import CheckpointRef, read_counters, save_checkpoint, verify_checkpoint
from ..artifacts.trajectories import TrajectoryStore
from ..artifacts.tracking import PolicyRef
from ..engines.base import Engine, PolicySource
from ..errors import ExpectedError
from ..run import RunSpec
from .completion import RunStores
from .publish import evaluate_policy, publish_checkpoint
from .records import StageRecords
from .stored_policies import registered_version

FINAL = "dpo_final"


class OfflineError(ExpectedError, RuntimeError):
    pass


def _write_once(uri: str, table: pa.Table) -> int:
    """Create a Lance table in one commit; an existing one is kept, never replaced."""
    if TrajectoryStore(uri).exists():
        return lance.dataset(uri).version
    return lance.write_dataset(table, uri, mode="create").version


def _group_keys(sel: pa.Table) -> list[tuple]:
    """Pairs never cross this key: one rollout group of one prompt in one source iteration."""
    return list(zip(sel["source"].to_pylist(), sel["run_id"].to_pylist(), sel["iteration"].to_pylist(),
                    sel["group_id"].to_pylist(), sel["prompt"].to_pylist()))


def pair_scores(sel: pa.Table, pair_on: str) -> np.ndarray:
    """The value that ranks samples within a group: the total reward or one named component."""
    if pair_on == "reward":
        return sel["reward"].to_numpy(zero_copy_only=False)
    metas = sel["prompt_meta"].to_pylist() if "prompt_meta" in sel.column_names else None
    return component_values(sel["rewards"].to_pylist(), pair_on, metas)


def _no_rows(tables: list[PinnedTable]) -> OfflineError:
    return OfflineError(f"the filters select no scored rollouts from {[t.ref for t in tables]}; "
                        f"loosen dpo.iteration_range / policy_versions / reward_min / categories")


def _no_pairs(groups: int, margin: float) -> OfflineError:
    return OfflineError(f"no preference pairs: all {groups} selected groups are tied or below margin "
                        f"{margin}; lower dpo.margin or select more rollouts")


def no_heldout_evaluation(dataset) -> str | None:
    """Why the dataset's held-out split cannot be evaluated (no held-out prompts), or None when it
    can (by its own evaluator, or the run's rewards)."""
    from ..datasets.registry import evaluates

    return None if evaluates(dataset) else f"dataset {dataset.name!r} has no held-out prompts (dataset.heldout_path)"


def check_sources(tables: list[PinnedTable], needs) -> None:
    """Every pinned source holds the fields the offline algorithm reads (its `needs`)."""
    for t in tables:
        sch = lance.dataset(t.uri, version=t.version).schema
        lacking = missing_fields(sch, needs)
        if lacking:
            raise OfflineError(f"source {t.ref} lacks the field(s) {lacking} that the offline algorithm needs; "
                               f"select rollouts of a run that stored them")
        if "cot_tokens" in sch.names:  # its images were generated after a chain of thought, not the plain prompt
            raise OfflineError(f"source {t.ref} holds rollouts with a chain of thought; offline training scores image "
                               f"tokens after the plain prompt and does not train on them yet — select rollouts of a "
                               f"run without sampling.cot_tokens")


def training_recipe(family, recipe_jsons) -> SamplerRecipe | None:
    """The recipe an offline update trains with: for a guidance-distilled family (FLUX.1-dev,
    FLUX.2-dev, HunyuanVideo — the scale is a transformer input) the archived rollouts' recipe, so
    the training forward runs at the embedded scale they were sampled at, as the online algorithms
    do (`sampling.conditional_scale`); None for any other family (its conditional forward)."""
    if getattr(family, "guidance", "cfg") != "embedded":
        return None
    if not recipe_jsons or any(r is None for r in recipe_jsons):
        raise OfflineError("some selected rows carry no sampler recipe, so the guidance scale a guidance-distilled "
                           "family sampled them at is unknown; select rollouts that recorded it (or, resuming a "
                           "run whose pairs predate it, start the DPO under a new run name)")
    recipes = [json.loads(r) for r in dict.fromkeys(recipe_jsons)]
    scales = sorted({float(r["guidance_scale"]) for r in recipes})
    if len(scales) > 1:
        raise OfflineError(f"the selected rollouts were sampled at guidance scales {scales} on a guidance-distilled "
                           f"family, whose training forward takes the scale as an input: an offline update trains at "
                           f"one — narrow dpo.source / iteration_range / policy_versions to rollouts of one scale")
    return stored_recipe(recipes[0], "flow")


def check_selection(tables: list[PinnedTable], d, needs=frozenset(), family=None) -> None:
    """Fail with the fix before anything is written: a source without the algorithm's fields, no
    rows selected, no pair formed, or (a guidance-distilled family) rows of several guidance scales."""
    check_sources(tables, needs)
    rows = select_rows(tables, d)
    if rows.num_rows == 0:
        raise _no_rows(tables)
    training_recipe(family, rows["recipe"].to_pylist())
    pairs = make_pairs(_group_keys(rows), pair_scores(rows, d.pair_on), d.pairing, d.margin)
    if pairs.count == 0:
        raise _no_pairs(pairs.groups, d.margin)


class OfflineStages:
    def __init__(self, spec: RunSpec, engine: Engine):
        self.spec, self.cfg, self.engine = spec, spec.cfg, engine
        if self.cfg.dpo is None:
            raise OfflineError("the config has no `dpo` section; use the shapes_dpo experiment or dpo=best_worst")
        self.d = self.cfg.dpo
        self.stores = RunStores(spec)
        self.tracker = self.stores.tracker
        self.records = StageRecords(spec.layout)
        root = f"{spec.table_uri.rsplit('/', 1)[0]}/{spec.run_id}"  # per run: a rerun under one name never reuses
        self.selection_uri = f"{root}/selection.lance"
        self.pairs_uri = f"{root}/pairs.lance"
        self.final_dir = spec.layout.checkpoints / FINAL

    def _log(self, metrics: dict | None, step: int) -> None:
        if metrics:
            self.tracker.log_metrics(self.spec.run_id, metrics, step=step)

    # --- select and pair ----------------------------------------------------------------------
    def select(self, tables: list[PinnedTable]) -> str:
        if not TrajectoryStore(self.selection_uri).exists():
            rows = select_rows(tables, self.d)
            if rows.num_rows == 0:
                raise _no_rows(tables)
            _write_once(self.selection_uri, rows)
            self._log({"selected_rows": float(rows.num_rows), "selected_sources": float(len(tables))}, 0)
        return self.selection_uri

    def pair(self) -> str:
        if TrajectoryStore(self.pairs_uri).exists():
            return self.pairs_uri
        sel = lance.dataset(self.selection_uri).to_table()
        rewards = sel["reward"].to_numpy(zero_copy_only=False)
        scores = pair_scores(sel, self.d.pair_on)
        pairs = make_pairs(_group_keys(sel), scores, self.d.pairing, self.d.margin)
        if pairs.count == 0:
            raise _no_pairs(pairs.groups, self.d.margin)
        w, lo = pairs.winner, pairs.loser
        take = lambda col, idx: sel[col].take(pa.array(idx))  # noqa: E731
        _write_once(self.pairs_uri, pa.table({
            "pair_id": pa.array(np.arange(pairs.count), pa.int64()),
            "prompt": take("prompt", w), "prompt_meta": take("prompt_meta", w),
            "source": take("source", w), "run_id": take("run_id", w), "iteration": take("iteration", w),
            "group_id": take("group_id", w),
            "winner_sample_id": take("sample_id", w), "loser_sample_id": take("sample_id", lo),
            "winner_reward": take("reward", w), "loser_reward": take("reward", lo),
            "margin": pa.array(scores[w] - scores[lo], pa.float32()), "recipe": take("recipe", w),
            **({"source_image": take("source_image", w)} if "source_image" in sel.column_names else {}),
        }))
        self._log({"pairs": float(pairs.count), "pair_groups": float(pairs.groups),
                   "groups_without_pair": float(pairs.groups_without_pair),
                   "pair_reward_margin": float(np.mean(rewards[w] - rewards[lo]))}, 0)
        return self.pairs_uri

    @property
    def payload_field(self) -> str:
        """What the offline algorithm trains on: final latents, or a token family's image tokens."""
        from ..models.registry import get_family

        return DECODE_INPUT[get_family(self.cfg.model.family).semantics.step.value]

    def _latents(self, pairs: pa.Table) -> np.ndarray:
        """Final latents (or image tokens) of the winners then the losers, read by key from the
        pinned source versions."""
        field = self.payload_field
        out = {}
        ids = set(pairs["winner_sample_id"].to_pylist()) | set(pairs["loser_sample_id"].to_pylist())
        runs = sorted(set(pairs["run_id"].to_pylist()))
        for src in sorted(set(pairs["source"].to_pylist())):
            uri, _, v = src.rpartition("@")
            t = lance.dataset(uri, version=int(v)).to_table(
                columns=["run_id", "sample_id", field],
                filter="run_id IN (" + ", ".join(f"'{r}'" for r in runs) + ")")
            lat = RolloutBatch.from_arrow(t.select([field]))[field]
            for i, (r, s) in enumerate(zip(t["run_id"].to_pylist(), t["sample_id"].to_pylist())):
                if s in ids:
                    out[(src, r, s)] = lat[i]
        keys = lambda col: zip(pairs["source"].to_pylist(), pairs["run_id"].to_pylist(), pairs[col].to_pylist())  # noqa: E731
        try:
            return np.stack([out[k] for col in ("winner_sample_id", "loser_sample_id") for k in keys(col)])
        except KeyError as exc:
            raise OfflineError(f"pair member {exc} is missing from its pinned source version") from None

    # --- update -------------------------------------------------------------------------------
    def _recipes(self, pairs: pa.Table) -> list:
        """The pairs' sampler recipes (a pairs table written before they were kept has none)."""
        if "recipe" in pairs.column_names:
            return pairs["recipe"].to_pylist()
        return [None] * pairs.num_rows

    def _source(self, uri: str, what: str) -> PolicySource:
        """'base' or models:/NAME/VERSION as weights to load (with fresh optimizer moments)."""
        if uri == "base":
            return PolicySource(None, None, with_optimizer=False)
        if not uri.startswith("models:/"):
            raise OfflineError(f"{uri!r}: expected 'base' or models:/NAME/VERSION")
        return PolicySource(self.stores.policy_dir(registered_version(self.tracker, uri, what)), None,
                            with_optimizer=False)

    def update(self) -> CheckpointRef:
        if self.final_dir.exists():  # renamed into place = complete; a checksum mismatch raises CorruptCheckpoint
            verify_checkpoint(self.final_dir)
            return CheckpointRef(str(self.final_dir), read_counters(self.final_dir)["checkpoint_id"], 0)
        d = self.d
        pairs = lance.dataset(self.pairs_uri).to_table()
        n = pairs.num_rows
        batch = RolloutBatch({self.payload_field: self._latents(pairs), "prompt": pairs["prompt"].to_pylist() * 2,
                              **({"source_image": pairs["source_image"].to_pylist() * 2}
                                 if "source_image" in pairs.column_names else {})})
        cats = [json.loads(m).get("category", "") if m else "" for m in pairs["prompt_meta"].to_pylist()]
        order = pair_order(cats, d.steps, d.pairs_per_step, d.balance, np.random.default_rng(self.cfg.run.seed))
        plan = [[[*idx, *(n + i for i in idx)]] for idx in order]  # one micro-batch: winners, then their losers
        ref = None if d.reference == "base" else self._source(d.reference, "dpo.reference")
        from ..models.registry import get_family

        recipe = training_recipe(get_family(self.cfg.model.family), self._recipes(pairs))
        result = self.engine.train(self._source(d.init, "dpo.init"), batch, plan, recipe, seed=self.cfg.run.seed, reference=ref)
        counters = {"iteration": 0, "optimizer_steps": d.steps, "pairs": n, "policy_version_in": 0,
                    "policy_model_in": d.init}
        try:
            for step, rec in enumerate(result.history):
                self._log({f"dpo/{k}": v for k, v in rec.items()}, step)
            ck = save_checkpoint(self.final_dir, result.weights, result.optimizer, counters, self.spec.config, result.ema)
        except BaseException:
            self.engine.invalidate()  # the engine holds trained weights that no checkpoint has
            raise
        self.engine.mark(ck.checkpoint_id)
        first, last = result.history[0], result.history[-1]
        self._log({"update_compute_s": result.metrics["update_compute_s"], "dpo/loss_first": first["loss"],
                   "dpo/loss_last": last["loss"]}, d.steps)
        return ck

    # --- publish and evaluate -----------------------------------------------------------------
    def publish(self, ckpt: CheckpointRef) -> PolicyRef:
        ref, new = publish_checkpoint(self.stores, 0, ckpt, {"algorithm": self.cfg.algorithm.name})
        if new:
            self._log({"policy_version": ref.version}, self.d.steps)
        return ref

    def evaluate(self, ckpt: CheckpointRef, policy: PolicyRef) -> dict:
        """Held-out accuracy before (the starting policy) and after, with the dataset's evaluator;
        the published version is tagged with it and competes for the experiment's `champion`."""
        done = self.records.read("evaluation", None)
        if done is not None:
            return done
        unevaluated = no_heldout_evaluation(self.cfg.dataset)
        if unevaluated:  # said on the run and in the result, not skipped silently
            res = {"heldout_before": None, "heldout_after": None, "not_evaluated": unevaluated}
            self.tracker.set_tags(self.spec.run_id, {"pixrl.not_evaluated": unevaluated})
            self.records.write("evaluation", None, res)
            return res
        per = self.d.eval_per_category
        before, _ = evaluate_policy(self.engine, self.stores, self._source(self.d.init, "dpo.init"), None, per)
        after, champion = evaluate_policy(self.engine, self.stores, PolicySource(Path(ckpt.uri), ckpt.checkpoint_id),
                                          policy, per)
        res = {"heldout_before": before["accuracy"], "heldout_after": after["accuracy"],
               "before": before, "after": after}
        metrics = {"heldout/accuracy_before": before["accuracy"], "heldout/accuracy": after["accuracy"],
                   **{f"heldout/{k}": v for k, v in after.items() if isinstance(v, float)}}
        if champion:
            metrics["heldout/champion_version"] = float(policy.version)
        self._log(metrics, self.d.steps)
        self.tracker.log_dict(self.spec.run_id, res, "evaluation.json")
        self.records.write("evaluation", None, res)
        return res
