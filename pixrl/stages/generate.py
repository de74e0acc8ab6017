"""The generate stage of an online iteration: the rows of a sampling round's rollout, made in
this process or by the engine's workers (who write them as uncommitted fragments), committed as
one table version — and, with run.staleness ≥ 1, the next iteration's rollout begun early on the
rollout workers (stages/rollout_prefetch.py).

A mixin of `OnlineStages` (stages/online.py), which provides the stores, the engine, the records
and the stage helpers these use.
"""

from __future__ import annotations

import json
import time

import numpy as np

from ..algorithms.recipe import with_guidance
from ..algorithms.token_sampling import behavior_gap
from ..artifacts.rollout_rows import decoded_fields, discard_fragments, rows_table
from ..artifacts.store_maintenance import maintain_store
from ..artifacts.tracking import PolicyRef
from ..artifacts.trajectories import TableRef, meta_json
from ..datasets.prompts import choose_prompts
from .plan import seed_of
from .rollout_calls import RolloutCalls


class GenerateStage:
    # --- generate -----------------------------------------------------------------------------
    def generate(self, iteration: int, policy: PolicyRef, rnd: int = 0) -> TableRef:
        return self._timed(self.stage_name("generate", rnd), iteration, lambda: self._generate(iteration, policy, rnd))

    def _draws(self, iteration: int, rnd: int):
        """The prompts of sampling round `rnd` and the iteration's sampler recipes, one per part
        (round 0's draw: every row of an iteration is replayed with its part's recipe)."""
        cfg, s = self.cfg, self.cfg.sampling
        rng = np.random.default_rng(seed_of(cfg.run.seed, iteration, 0))
        prompts = choose_prompts(self.prompt_items, s.prompts_per_iteration, rng)
        parts = [with_guidance(p, s) for p in self.algorithm.rollout_parts(s, rng, self.step_kind, iteration)]
        if rnd:
            rng = np.random.default_rng(seed_of(cfg.run.seed, iteration, 0, rnd))
            prompts = choose_prompts(self.prompt_items, s.prompts_per_iteration, rng)
        return prompts, parts

    def _layout(self, rnd: int, prompts, parts: list) -> tuple[list, list[tuple]]:
        """Rows (group slot, member, prompt) in generation order, and (recipe, first row, end) per
        part: part i's group of prompt k is slot r·P + i·P + k (round r holds slots [r·P, (r+1)·P)
        with one part; an algorithm in parts samples one round)."""
        P, G = self.cfg.sampling.prompts_per_iteration, self.cfg.sampling.group_size
        first = rnd * P
        rows = [(first + i * P + k, g, p) for i in range(len(parts)) for k, p in enumerate(prompts) for g in range(G)]
        n = len(prompts) * G
        return rows, [(rec, i * n, (i + 1) * n) for i, rec in enumerate(parts)]

    def _noise_seeds(self, iteration: int, rnd: int, rows, recipe) -> list[int] | None:
        """The seeds of shared initial latents (recipe.shared_noise): one per group, or with
        `shared_members` one per prompt and member block, the same in every part."""
        if not getattr(recipe, "shared_noise", False):
            return None
        P, K = self.cfg.sampling.prompts_per_iteration, recipe.shared_members
        at = lambda slot, g: (rnd * P + (slot - rnd * P) % P, *((g // K,) if K else ()))  # noqa: E731  (prompt, block)
        return [seed_of(self.cfg.run.seed, iteration, 3, *at(slot, g)) for slot, g, _ in rows]

    def _generate(self, iteration: int, policy: PolicyRef, rnd: int):
        if self.stores.complete("generate", iteration, rnd):
            return self.stores.latest(), None
        if self.table.exists() and rnd == 0:  # index new fragments, drop stale versions: stage cost stays flat
            maintain_store(self.table, iteration)
        rows, columns, call, decoded = self._rollout_call(iteration, policy, rnd)
        scope = self.stores.round_scope(rnd)
        to_store = getattr(self.engine, "rollout_to_store", None)  # workers write their rows themselves
        in_process = self.overlap is not None or to_store is None  # this process stores the rows
        extra = {}
        if in_process:
            batch, seconds = self._rollout_here((iteration, rnd), call, columns)
            table = rows_table(batch, columns, decoded, self.step_kind)
            if "cot_behavior_log_probs" in batch:  # the text came from a server: how far it is from the policy
                extra = behavior_gap(batch["cot_log_probs"], batch["cot_behavior_log_probs"], batch["cot_mask"])
        else:
            key, t0 = self._prefetch_key(iteration, policy), time.perf_counter()
            fetched = self.prefetch.take(key) if rnd == 0 else None
            if fetched is not None:  # begun during the previous iteration: what was left of it
                extra = {"prefetch/wait_s": time.perf_counter() - t0}
            else:
                fetched = self._rollout_to_store(iteration, rnd, call, columns, decoded, to_store)
            fragments, schema, seconds, create = fetched
        try:
            metrics = self._commit_record("generate", iteration, rnd,
                                          {"images_per_s": len(rows) / seconds, "generate_compute_s": seconds, **extra})
            if in_process:
                ref = self.table.append(table, where=scope)
            else:
                ref = self.table.commit_appended(fragments, schema, create, self.spec.run_id, iteration, scope)
        except BaseException:
            if not in_process:  # the workers' rows were never committed: their files go now
                discard_fragments(self.table.uri, fragments)
            raise
        if self.overlap is not None:
            self.overlap.committed((iteration, rnd), ref.version)
        self.table.tag(f"{self.spec.run_name}-it{iteration}-{self.stage_name('generate', rnd)}", ref.version)
        return ref, metrics

    def _rollout_call(self, iteration: int, policy: PolicyRef, rnd: int):
        """(rows, their columns, the engine calls, the optional columns decode fills) of a sampling
        round's rollout: a function of the run seed, the iteration, the round and the policy version
        alone."""
        prompts, parts = self._draws(iteration, rnd)
        rows, calls = self._layout(rnd, prompts, parts)
        seeds = [seed_of(self.cfg.run.seed, iteration, 1, slot, g) for slot, g, _ in rows]
        noise_seeds = self._noise_seeds(iteration, rnd, rows, parts[0])  # a group's members start from one latent
        info = self.engine.describe()
        columns = self._row_columns(iteration, policy, rows, seeds, calls, info)
        if noise_seeds:
            columns["noise_seed"] = noise_seeds
        images = [p.image for _, _, p in rows] if any(p.image is not None for _, _, p in rows) else None
        if images is not None:  # an editing dataset: each row keeps the source image it was conditioned on
            columns["source_image"] = images
        call = RolloutCalls(self.source(policy), [p.prompt for _, _, p in rows], seeds, noise_seeds, images, calls)
        return rows, columns, call, decoded_fields(info)

    def _rollout_to_store(self, iteration: int, rnd: int, call: RolloutCalls, columns: dict, decoded: tuple,
                          to_store) -> tuple[list, object, float, bool]:
        """The engine's workers write the round's rows as uncommitted fragments."""
        self.table.ensure_absent(self.spec.run_id, iteration, self.stores.round_scope(rnd))  # before any worker writes
        create = not self.table.exists()
        return (*call.to_store(to_store, self.table.uri, columns, decoded, self.step_kind, create), create)

    def _prefetch_key(self, iteration: int, policy: PolicyRef) -> tuple:
        return iteration, policy.model_name, policy.version

    def prefetch_rollout(self, iteration: int, policy: PolicyRef) -> None:
        """Begin `iteration`'s rollout with `policy` on the engine's rollout workers, committed
        later by its generate stage (run.staleness ≥ 1; stages/rollout_prefetch.py). The replay
        encodings of the update in progress are asked of the workers first: they would
        otherwise queue behind this rollout."""
        to_store = getattr(self.engine, "rollout_to_store", None)
        if to_store is None or self.overlap is not None or self.stores.complete("generate", iteration, 0):
            return
        self._warm_update(iteration - 1)
        _, columns, call, decoded = self._rollout_call(iteration, policy, 0)
        self.prefetch.begin(self._prefetch_key(iteration, policy),
                            lambda: self._rollout_to_store(iteration, 0, call, columns, decoded, to_store),
                            discard=lambda fetched: discard_fragments(self.table.uri, fetched[0]))

    def _warm_update(self, iteration: int) -> None:
        """Ask the engine now for what iteration's update will ask of its rollout workers (the
        replay's prompt encodings): the same rows and recipe `train_into` reads."""
        warm = getattr(self.engine, "warm_replay", None)
        if warm is None or iteration < 0:
            return
        warm(*self.update_inputs(self.stores.latest(), iteration, []))

    def _rollout_here(self, key, call: RolloutCalls, columns: dict):
        """The rollout in this process; with reward.overlap each micro-batch is decoded and scored
        while the next one generates (a failed rollout discards what was begun)."""
        hook = None
        if self.overlap is not None:
            metas = [json.loads(m) for m in columns["prompt_meta"]]  # as score reads them
            for meta, image in zip(metas, call.images or ()):
                meta["source_image"] = image
            hook = self.overlap.begin(key, columns["sample_id"], columns["prompt"], metas)
        try:
            return call.rollout(self.engine, hook)
        except BaseException:
            if self.overlap is not None:
                self.overlap.discard(key)
            raise

    def _row_columns(self, iteration: int, policy: PolicyRef, rows, seeds: list[int], calls, info: dict) -> dict:
        """The stage's per-row columns of generate: keys, prompt, group, seed, policy version,
        family facts and the sampler recipe of the row's part (JSON)."""
        cfg, s = self.cfg, self.cfg.sampling
        n, sem = len(rows), info["semantics"]
        if self.step_kind == "token":
            geometry = {"resolution": info["resolution"], "image_tokens": info["image_tokens"]}
        else:
            geometry = {"resolution": list(info["latent_shape"])}
        recipes = []
        for recipe, lo, hi in calls:
            recipes += [json.dumps({**recipe.to_dict(), **geometry, "dtype": cfg.model.dtype,
                                    "engine": cfg.run.engine, "torch": info["torch"], "micro_batch": s.micro_batch,
                                    "shift": info.get("shift"), **({"frames": info["frames"]} if info.get("video") else {}),
                                    **({"sigmas": info["sigmas"]} if info.get("sigmas") else {}),
                                    **({"cot_backend": "vllm", "cot_server": s.cot_vllm_url}
                                       if s.cot_tokens and s.cot_backend == "vllm" else {})})] * (hi - lo)
        return dict(
            run_id=[self.spec.run_id] * n, iteration=[iteration] * n,
            sample_id=[f"{iteration:05d}-{slot:03d}-{g:02d}" for slot, g, _ in rows],
            prompt_id=[p.prompt_id for _, _, p in rows], prompt=[p.prompt for _, _, p in rows],
            prompt_meta=[meta_json(p.meta) for _, _, p in rows], group_id=[slot for slot, _, _ in rows],
            sample_index=[g for _, g, _ in rows], seed=seeds, policy_version=[policy.version] * n,
            family=[info["family"]] * n, regime=[sem.regime.value] * n, step_kind=[sem.step.value] * n,
            recipe=recipes)

