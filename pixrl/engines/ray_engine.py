"""The Ray engine (`run.engine=ray`): the Engine protocol over pools of Ray actors — rollout
workers, reward workers on their own resources, and a trainer group under torch.distributed.
The stage layer, the stores, resume and lineage are the local engine's; only where the compute
runs changes.

- rollout: each worker generates a contiguous run of whole micro-batches, with the prompts
  encoded as the whole call encodes them, so the concatenated shards are the local engine's rows
  bit for bit, and writes them to the trajectory table as uncommitted fragments that the stage
  commits in one version (`rollout_to_store`: the latents never pass through the driver);
- decode: each rollout worker decodes whole fragments of the iteration read from the table and
  writes their image columns itself, the stage committing one version (`decode_to_store`);
  `decode` on arrays splits at the family's decode batch;
- score: contiguous shards over the reward workers (a model-based scorer loads once per worker),
  each reading its rows' images from the table (`score_from_store`; artifacts/column_writes.py);
- evaluate: the evaluation's images in shards of whole generation batches, judged here;
- train: every rank replays its share of each optimizer step's micro-batches, gradients summed
  over the group (engines/collective.py), with the prompt conditioning rollout worker 0 encoded
  (its rollout's own, from its cache; a rank holds no text towers of a family whose encoders are
  apart from the trained module); rank 0 returns the new state, which the stage layer
  checkpoints and publishes; rollout workers load exactly the version a stage names, from the
  checkpoint store — weights move by version, never actor to actor.

Prefect tasks call this engine directly (engine calls from the tasks, not prefect-ray's task
runner): actors keep models and optimizer moments loaded across stages and iterations, while the
task runner's remote functions are stateless (and under an ephemeral Prefect API each Ray
worker would start its own server).

A worker that dies mid-call is restarted by Ray (`ray.max_restarts`); the call fails as a
transient WorkerLost, and the stage's task retry reruns it on the restarted worker. A trainer
group that lost a rank is rebuilt whole before the next update.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import numpy as np

from ..artifacts.batch import RolloutBatch
from ..artifacts.column_writes import ColumnFile, RowsRead, discard_column_files
from ..artifacts.rollout_rows import discard_fragments
from ..errors import exception_chain
from ..models.source_images import condition_keys
from ..rewards.base import ScoringError, group_keys
from ..rewards.routing import merge_parts
from ..stages.faults import TransientError
from .base import PolicySource, TrainResult
from .ray_cluster import actor_options, connect, import_ray, worker_threads
from .ray_workers import RewardWorker, RolloutWorker, TrainerWorker, trainer_takes_encodings
from .update import replay_prompt_sets


class WorkerLost(TransientError):
    """A Ray worker died during a call (node lost, OOM, killed); a retry runs on its restart."""


def _shards(n: int, unit: int, parts: int) -> list[tuple[int, int]]:
    """Up to `parts` contiguous [lo, hi) ranges covering n rows, each starting on a multiple of
    `unit` (whole micro-batches / decode batches), as even as whole units allow."""
    units = math.ceil(n / unit)
    bounds = np.linspace(0, units, min(parts, units) + 1).round().astype(int)
    return [(int(a) * unit, min(int(b) * unit, n)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _group_shards(keys: list[str], parts: int) -> list[tuple[int, int]]:
    """Up to `parts` contiguous [lo, hi) ranges of whole groups (rows in generation order hold a
    group's rows together), as even as whole groups allow: a group reward's shards."""
    starts = [0] + [i for i in range(1, len(keys)) if keys[i] != keys[i - 1]]
    if len(starts) != len(set(keys)):
        raise RuntimeError("a group's rows are not together in the scored rows; a group reward needs whole groups")
    cuts = sorted({min(starts, key=lambda s: abs(s - len(keys) * k / parts)) for k in range(parts)} | {len(keys)})
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def _balanced(reads: list[RowsRead], parts: int) -> list[list[RowsRead]]:
    """Whole fragments in up to `parts` groups, in order, of about equal rows (a fragment goes to
    the share its middle row falls in); no empty group."""
    total, groups, done = sum(r.rows for r in reads), [[] for _ in range(parts)], 0
    for r in reads:
        groups[min(parts - 1, int((done + r.rows / 2) * parts / total))].append(r)
        done += r.rows
    return [g for g in groups if g]


def _replay_key(batch: RolloutBatch, recipe, prompt_sets) -> tuple:
    """What a replay's encodings depend on: the rows' prompts and source images, the replay
    recipe and each row's prompt set."""
    images = list(batch["source_image"]) if "source_image" in batch else None
    sets = None if prompt_sets is None else tuple(np.asarray(prompt_sets).tolist())
    return tuple(condition_keys(list(batch["prompt"]), images)), repr(recipe), sets


class RayEngine:
    def __init__(self, cfg):
        self.cfg = cfg
        self.ray = import_ray()
        self.started = connect(cfg)
        self._cfg_json = cfg.model_dump(mode="json")
        r = cfg.ray
        self.rollout_workers = [self._actor(RolloutWorker, r.rollout, i) for i in range(r.rollout_workers)]
        self.reward_workers = [self._actor(RewardWorker, r.reward, i) for i in range(r.reward_workers)]
        self._groupwise: bool | None = None  # whether a reward compares samples within groups (score shards)
        self._shares_encodings = trainer_takes_encodings(cfg.model.family)  # worker 0 encodes for the others
        self.trainers: list | None = None
        self._described: dict | None = None
        self._decode_batch: int | None = None
        self._warm: tuple | None = None  # (rows' key, encodings) asked ahead of a train (warm_replay)

    def _actor(self, cls, res, index: int, restarts: int | None = None):
        opts = actor_options(res, self.cfg.ray, restarts)
        return self.ray.remote(cls).options(**opts).remote(self._cfg_json, index, worker_threads(res, self.cfg))

    def _get(self, refs: list, what: str, workers: list, rows: list[tuple[str, str]] | None = None,
             undo=None) -> list:
        """The results of one call per worker, once every call has ended. A worker that died →
        WorkerLost (transient: the stage retries on its restart), whatever the others raised
        meanwhile (a trainer rank fails when its peer dies); a worker's own error → re-raised
        naming the worker and, for a shard of rows, its first and last sample (a ScoringError
        stays one: the user fixes the scorer, a retry would not). `undo(results)`: given what the
        workers that did finish returned, before either is raised (their files, which nothing
        will commit, deleted)."""
        ray, errors = self.ray, self.ray.exceptions
        ray.wait(refs, num_returns=len(refs))
        out, failures, lost = [], [], None
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except (errors.RayActorError, errors.ObjectLostError) as exc:
                lost = lost or (i, exc)
            except errors.RayTaskError as exc:
                failures.append((i, exc.cause if isinstance(exc.cause, BaseException) else exc))
        if (lost or failures) and undo is not None:
            try:
                undo(out)
            except Exception as exc:  # the workers' failure is the error to raise; the stray files are logged
                logging.getLogger(__name__).warning("could not delete the files the finished %s workers wrote "
                                                    "(Lance's cleanup removes them later): %s", what, exc)
        if lost:
            i, exc = lost
            self._await_restart(workers[i])
            raise WorkerLost(f"{what} worker {i} died ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                             f"the stage's retry reruns it on the restarted worker") from exc
        if not failures:
            return out
        i, cause = failures[0]
        name = f"{what} worker {i}{self._where(workers[i])}"
        if rows is not None:
            name += f", samples {rows[i][0]} … {rows[i][1]}"
        err_type = ScoringError if any(isinstance(e, ScoringError) for e in exception_chain(cause)) else RuntimeError
        raise err_type(f"{name}: {type(cause).__name__}: {cause}") from cause

    def _await_restart(self, worker, timeout_s: float = 180.0) -> None:
        """Wait until a worker Ray is restarting answers again (or is dead for good), so that the
        stage's retry finds it up: under load a restart (its model load) outlasted the retries,
        each refused at once with "the actor is restarting"."""
        import time

        errors, deadline = self.ray.exceptions, time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.ray.get(worker.where.remote(), timeout=10)
                return
            except errors.ActorUnavailableError:  # restarting: calls are refused until it is up
                time.sleep(0.5)
            except errors.GetTimeoutError:
                continue
            except errors.RayActorError:  # dead for good (no restarts left): the retry says so
                return

    def _where(self, worker) -> str:
        try:
            w = self.ray.get(worker.where.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - the message still names the worker's index
            return ""
        return f" (node {w['node']}, pid {w['pid']})"

    # --- facts --------------------------------------------------------------------------------
    def describe(self) -> dict:
        if self._described is None:
            info = self._get([self.rollout_workers[0].describe.remote()], "rollout", self.rollout_workers)[0]
            self._described = {**info, "engine": "ray"}
        return self._described

    # --- rollout, decode, score ---------------------------------------------------------------
    def _sharded_rollout(self, method: str, *args, images=None, undo=None) -> list:
        """`method` of every rollout worker on its run of whole micro-batches of the call; the
        workers after the first are given the call's encodings, made by worker 0. `images`: each
        prompt's source image (an editing family), passed to every worker with the whole call."""
        prompts, recipe = args[1], args[3]
        shards = _shards(len(prompts), self.cfg.sampling.micro_batch, len(self.rollout_workers))
        given = self._call_encodings(condition_keys(prompts, images), recipe, images) if len(shards) > 1 else None
        images = None if images is None else self.ray.put(images)  # in the object store once, not once per worker
        refs = [getattr(w, method).remote(*args[:5], rows, *args[5:], None if k == 0 else given, images)
                for k, (w, rows) in enumerate(zip(self.rollout_workers, shards))]
        return self._get(refs, "rollout", self.rollout_workers, undo=undo)

    def _call_encodings(self, keys: list[str], recipe, images=None):
        """The call's prompts (and negative prompt) encoded by rollout worker 0 as its own rollout
        encodes them — a cache hit there — in the object store once for the other workers, which
        hold no text towers; None for a family whose workers encode themselves (token ids)."""
        if not self._shares_encodings:
            return None
        ref = self.rollout_workers[0].encodings.remote([list(keys)], recipe, images)
        return self.ray.put(self._get([ref], "rollout", self.rollout_workers)[0])

    def rollout(self, policy: PolicySource, prompts: list[str], seeds: list[int], recipe,
                noise_seeds: list[int] | None = None, images=None) -> tuple[RolloutBatch, float]:
        parts = self._sharded_rollout("rollout", policy, prompts, seeds, recipe, noise_seeds, images=images)
        return RolloutBatch.concat([b for b, _ in parts]), max(s for _, s in parts)

    def rollout_to_store(self, policy: PolicySource, prompts: list[str], seeds: list[int], recipe,
                         noise_seeds: list[int] | None = None, sink=None, images=None) -> tuple[list, object, float]:
        """The same shards as `rollout`, each worker writing its rows as Lance fragments through
        `sink` (artifacts/rollout_rows.py): (every fragment in row order, the rows' schema, the
        slowest worker's seconds). The stage commits them as one version; when a worker fails, the
        others' fragments are deleted before the error is raised (nothing will commit them)."""
        undo = lambda done: discard_fragments(sink.uri, [f for frags, _, _ in done for f in frags])  # noqa: E731
        parts = self._sharded_rollout("rollout_rows", policy, prompts, seeds, recipe, noise_seeds, sink, images=images,
                                      undo=undo)
        return [f for frags, _, _ in parts for f in frags], parts[0][1], max(sec for _, _, sec in parts)

    def _decode_shards(self, n: int) -> list[tuple[int, int]]:
        """The rollout workers' shares of n rows to decode: whole decode batches of the family."""
        if self._decode_batch is None:
            self._decode_batch = self._get([self.rollout_workers[0].decode_batch.remote()], "decode",
                                           self.rollout_workers)[0]
        return _shards(n, self._decode_batch, len(self.rollout_workers))

    def decode(self, final_latents: np.ndarray, prompts: list[str] | None = None) -> np.ndarray:
        shards = self._decode_shards(len(final_latents))
        refs = [w.decode.remote(final_latents[lo:hi], None if prompts is None else prompts[lo:hi])
                for w, (lo, hi) in zip(self.rollout_workers, shards)]
        return np.concatenate(self._get(refs, "decode", self.rollout_workers))

    def soundtracks(self, final_latents: np.ndarray) -> list[bytes] | None:
        """`decode`'s clips' soundtracks (WAV), in the same shards over the rollout workers."""
        if not self.describe().get("audio"):
            return None
        shards = self._decode_shards(len(final_latents))
        refs = [w.soundtracks.remote(final_latents[lo:hi]) for w, (lo, hi) in zip(self.rollout_workers, shards)]
        return [s for part in self._get(refs, "decode", self.rollout_workers) for s in part]

    def decode_to_store(self, reads: list[RowsRead], field: str) -> tuple[list[ColumnFile], float]:
        """Each rollout worker decodes whole fragments of the iteration (`reads`) and writes their
        image columns as uncommitted column files, so neither latents nor images pass through the
        driver: (every file, the slowest worker's seconds). The stage commits them as one version;
        when a worker fails, the others' column files are deleted before the error is raised."""
        groups = _balanced(reads, len(self.rollout_workers))
        used = self.rollout_workers[:len(groups)]
        undo = lambda done: discard_column_files(reads, [f for files, _ in done for f in files])  # noqa: E731
        parts = self._get([w.decode_rows.remote(g, field) for w, g in zip(used, groups)], "decode", used, undo=undo)
        return [f for files, _ in parts for f in files], max(sec for _, sec in parts)

    def score_from_store(self, rows: RowsRead, iteration: int) -> tuple[dict[str, np.ndarray], float]:
        """`score` with each reward worker reading its contiguous shard's images, prompts and
        metadata from the table itself: (the rewards in `rows.sample_ids` order, the slowest
        worker's seconds)."""
        ids = rows.sample_ids
        shards = self._score_shards(ids, [""] * len(ids))
        refs = [w.score_rows.remote(replace(rows, sample_ids=ids[lo:hi]), iteration)
                for w, (lo, hi) in zip(self.reward_workers, shards)]
        parts = self._get(refs, "reward", self.reward_workers, [(ids[lo], ids[hi - 1]) for lo, hi in shards])
        sizes = [hi - lo for _, (lo, hi) in zip(parts, shards)]
        return merge_parts([p for p, _ in parts], sizes), max(sec for _, sec in parts)

    def _score_shards(self, sample_ids: list[str], prompts: list[str]) -> list[tuple[int, int]]:
        """The reward workers' contiguous shares: any rows, or whole groups for a group reward."""
        if self._groupwise is None:
            from ..rewards.compose import RewardSet

            self._groupwise = RewardSet.from_config(self.cfg.reward).groupwise
        if self._groupwise:
            return _group_shards(group_keys(prompts, sample_ids), len(self.reward_workers))
        return _shards(len(sample_ids), 1, len(self.reward_workers))

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict],
              sample_ids: list[str]) -> dict[str, np.ndarray]:
        shards = self._score_shards(sample_ids, prompts)
        refs = [w.score.remote(images[lo:hi], prompts[lo:hi], metadata[lo:hi], sample_ids[lo:hi])
                for w, (lo, hi) in zip(self.reward_workers, shards)]
        names = [(sample_ids[lo], sample_ids[hi - 1]) for lo, hi in shards]
        parts = self._get(refs, "reward", self.reward_workers, names)
        return merge_parts(parts, [hi - lo for _, (lo, hi) in zip(parts, shards)])

    # --- train --------------------------------------------------------------------------------
    def _trainer_group(self) -> list:
        """The trainer ranks, joined in one process group (built on first use, rebuilt whole
        after a rank was lost: a survivor's group cannot take a new member)."""
        if self.trainers is None:
            r = self.cfg.ray
            backend = r.backend if r.backend != "auto" else ("nccl" if r.trainer.num_gpus > 0 else "gloo")
            ranks = [self._actor(TrainerWorker, r.trainer, i, restarts=0) for i in range(r.trainer_workers)]
            master = self._get([ranks[0].rendezvous.remote()], "trainer", ranks)[0]
            self._get([t.join.remote(len(ranks), master, backend, r.trainer_sharding) for t in ranks], "trainer", ranks)
            self.trainers = ranks
        return self.trainers

    def _drop_trainers(self) -> None:
        for t in self.trainers or []:
            self.ray.kill(t, no_restart=True)
        self.trainers = None

    def train(self, policy: PolicySource, batch: RolloutBatch, plan, recipe, seed: int = 0,
              reference: PolicySource | None = None, prompt_sets=None,
              stored: dict[str, PolicySource] | None = None) -> TrainResult:
        ranks = self._trainer_group()
        batch_ref = self.ray.put(batch)
        encodings = self._replay_encodings(batch, recipe, prompt_sets)
        try:
            results = self._get([t.train.remote(policy, batch_ref, plan, recipe, seed, reference, prompt_sets,
                                                 encodings, stored) for t in ranks], "trainer", ranks)
        except BaseException:
            self._drop_trainers()  # a rank may be dead or hold half-stepped weights
            raise
        return results[0]

    def warm_replay(self, batch: RolloutBatch, recipe, prompt_sets) -> None:
        """Ask rollout worker 0 now for the encodings a coming `train` of these rows will need
        (run.staleness: before the next iteration's rollout occupies the worker); `train` uses
        them only for exactly these prompts, images, recipe and prompt sets."""
        self._warm = None
        if trainer_takes_encodings(self.cfg.model.family):
            self._warm = (_replay_key(batch, recipe, prompt_sets), self._ask_encodings(batch, recipe, prompt_sets))

    def _replay_encodings(self, batch: RolloutBatch, recipe, prompt_sets):
        """The replay's prompt sets (and negative prompt) encoded by rollout worker 0 — a cache hit
        for the sets its rollout encoded, or asked ahead (`warm_replay`) — put once in the object
        store for every rank; None for a family whose trainer ranks encode themselves (a token
        family's prompts are its own ids)."""
        if not trainer_takes_encodings(self.cfg.model.family):
            return None
        warm, self._warm = self._warm, None
        if warm is not None and warm[0] == _replay_key(batch, recipe, prompt_sets):
            return warm[1]
        return self._ask_encodings(batch, recipe, prompt_sets)

    def _ask_encodings(self, batch: RolloutBatch, recipe, prompt_sets):
        images = list(batch["source_image"]) if "source_image" in batch else None
        sets = list(replay_prompt_sets(condition_keys(list(batch["prompt"]), images), prompt_sets).values())
        ref = self.rollout_workers[0].encodings.remote(sets, recipe, images)
        return self.ray.put(self._get([ref], "rollout", self.rollout_workers)[0])

    def mark(self, checkpoint_id: str) -> None:
        if self.trainers is not None:
            self._get([t.mark.remote(checkpoint_id) for t in self.trainers], "trainer", self.trainers)

    def invalidate(self) -> None:
        if self.trainers is not None:
            try:
                self._get([t.invalidate.remote() for t in self.trainers], "trainer", self.trainers)
            except Exception:  # noqa: BLE001 - a lost rank: the group is rebuilt before the next update
                self._drop_trainers()

    # --- evaluate -----------------------------------------------------------------------------
    def evaluate(self, policy: PolicySource, dataset: str, split: str, per_category: int) -> dict:
        """The dataset's evaluator with its images made in shards over the rollout workers (whole
        generation batches each: the images one process makes), judged here — a dataset without
        its own evaluator by the run's rewards on the reward workers; an evaluator that cannot be
        split runs whole on worker 0."""
        from ..datasets.prompts import split_items
        from ..datasets.registry import evaluator_of
        from ..datasets.reward_eval import join_samples

        ev = evaluator_of(dataset, self.score)  # a dataset without its own: the run's rewards, on the reward workers
        needs = ("pairs", "images", "aggregate", *(("encodings",) if self._shares_encodings else ()))
        if not all(hasattr(ev, part) for part in needs):
            ref = self.rollout_workers[0].evaluate.remote(policy, dataset, split, per_category)
            return self._get([ref], "rollout", self.rollout_workers)[0]
        pairs = ev.pairs(split_items(self.cfg.dataset, split), per_category)
        shards = _shards(len(pairs), ev.batch, len(self.rollout_workers))
        encoded = [None] * len(shards)  # worker 0 encodes the other shards' prompts: they hold no text towers
        if self._shares_encodings and len(shards) > 1:
            first = self.rollout_workers[0]
            encoded[1:] = self._get([first.eval_encodings.remote(dataset, pairs[lo:hi]) for lo, hi in shards[1:]],
                                    "rollout", [first] * (len(shards) - 1))
        refs = [w.eval_images.remote(policy, dataset, pairs[lo:hi], enc)
                for w, (lo, hi), enc in zip(self.rollout_workers, shards, encoded)]
        return ev.aggregate(pairs, join_samples(self._get(refs, "rollout", self.rollout_workers)))

    def close(self) -> None:
        """Stop this engine's workers (and the local Ray it started)."""
        for w in [*self.rollout_workers, *self.reward_workers, *(self.trainers or [])]:
            self.ray.kill(w, no_restart=True)
        self.trainers = None
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()

