"""The Ray engine's workers: plain classes that `ray.remote` turns into actors. Each holds what
the local engine holds for its kind of work, loaded once and kept across stages and iterations:

- RolloutWorker: the family and the policy version it last loaded (rollout, decode, evaluation images);
- RewardWorker: the reward set, its model-based scorers set up once on the worker's device;
- TrainerWorker: one rank of the update's torch.distributed group (weights, optimizer moments);
  a family with separate text encoders is loaded without them — the replay's prompt conditioning
  comes from a rollout worker, the encodings its rollout used (T5-XXL, Qwen2.5-VL or FLUX.2's
  Mistral are never read on a trainer rank).

Every computation is the local engine's own code (a LocalEngine inside the actor), so a shard
of a call gives exactly the rows the local engine gives for them.

Drills: `PIXRL_WORKER_FAULT=<kind>:<index>:<marker>` (comma-separated) makes worker <index> of
<kind> (rollout, reward, trainer) SIGKILL itself when its next call begins, once — the marker
file, created first, records that it fired (it must be on a filesystem the worker sees).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

FAULT_ENV = "PIXRL_WORKER_FAULT"


def worker_fault_point(kind: str, index: int) -> None:
    for item in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        f_kind, f_index, marker = item.split(":", 2)
        if (f_kind, int(f_index)) != (kind, index):
            continue
        try:
            Path(marker).touch(exist_ok=False)  # once: a restarted worker finds the marker
        except FileExistsError:
            continue
        os.kill(os.getpid(), signal.SIGKILL)


def trainer_takes_encodings(family: str) -> bool:
    """Whether trainer ranks load `family` without its text towers and replay with encodings
    a rollout worker gives them (every family whose text encoders are apart from the trained module)."""
    from ..models.registry import get_family

    return bool(getattr(get_family(family), "separate_text_towers", False))


def _engine(cfg_json: dict, threads: int):
    import torch

    from ..config.schema import ExperimentConfig
    from .local import LocalEngine

    cfg = ExperimentConfig.model_validate(cfg_json)
    torch.set_num_threads(threads)
    return LocalEngine(cfg)


class _Worker:
    kind = "worker"

    def __init__(self, cfg_json: dict, index: int, threads: int):
        self.index = index
        self.engine = _engine(cfg_json, threads)

    def where(self) -> dict:
        """Node, PID and visible devices: error messages name the worker by these."""
        import ray

        return {"kind": self.kind, "index": self.index, "node": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "gpus": [str(g) for g in ray.get_gpu_ids()]}


class RolloutWorker(_Worker):
    """Worker 0 holds the family's text towers and encodes for the others, which load without
    them (a family whose text encoders are apart from its denoiser): each call's prompts are
    encoded once, by worker 0, as the whole call encodes them."""

    kind = "rollout"

    def __init__(self, cfg_json: dict, index: int, threads: int):
        super().__init__(cfg_json, index, threads)
        self.engine.text_towers = index == 0 or not trainer_takes_encodings(self.engine.cfg.model.family)

    def describe(self) -> dict:
        return self.engine.describe()

    def rollout(self, policy, prompts, seeds, recipe, noise_seeds, rows, encodings=None, images=None):
        worker_fault_point(self.kind, self.index)
        return self.engine.rollout(policy, prompts, seeds, recipe, noise_seeds=noise_seeds, rows=rows,
                                   encodings=encodings, images=images)

    def rollout_rows(self, policy, prompts, seeds, recipe, noise_seeds, rows, sink, encodings=None, images=None):
        """Rows [lo, hi) of the call, written as uncommitted fragments: (fragments, schema, seconds)."""
        batch, seconds = self.rollout(policy, prompts, seeds, recipe, noise_seeds, rows, encodings, images)
        table = sink.rows(batch, *rows)
        return sink.write(table), table.schema, seconds

    def decode(self, final_latents, prompts=None):
        worker_fault_point(self.kind, self.index)
        return self.engine.decode(final_latents, prompts)

    def soundtracks(self, final_latents):
        worker_fault_point(self.kind, self.index)
        return self.engine.soundtracks(final_latents)

    def decode_rows(self, reads, field: str) -> tuple[list, float]:
        """Whole fragments' rows decoded, their image (and soundtrack) columns written as uncommitted files:
        (one ColumnFile per fragment, seconds of decoding and encoding)."""
        import time

        import pyarrow as pa

        from ..artifacts.batch import RolloutBatch
        from ..artifacts.column_writes import decoded_columns

        worker_fault_point(self.kind, self.index)
        files, seconds = [], 0.0
        for r in reads:
            t = r.read([field, "prompt"])
            t0 = time.perf_counter()
            cols = decoded_columns(self.engine, RolloutBatch.from_arrow(t.select([field]))[field],
                                   t["prompt"].to_pylist())
            seconds += time.perf_counter() - t0
            files.append(r.write_columns(pa.table({"_rowid": t["_rowid"], **cols})))
        return files, seconds

    def decode_batch(self) -> int:
        return int(getattr(self.engine.policy.family, "decode_batch", 64))

    def evaluate(self, policy, dataset: str, split: str, per_category: int) -> dict:
        return self.engine.evaluate(policy, dataset, split, per_category)

    def encodings(self, prompt_sets: list[list[str]], recipe, images=None) -> dict:
        """The prompt sets' conditioning as this worker's rollout encoded them (cached), in host
        memory; `images`: the source images their condition keys name (an editing family)."""
        worker_fault_point(self.kind, self.index)
        return self.engine.encodings(prompt_sets, recipe, images)

    def eval_images(self, policy, dataset: str, pairs: list, encoded: dict | None = None) -> object:
        """The images of a shard of an evaluation's (prompt, seed) pairs, under `policy`; `encoded`:
        their prompt encodings, made by worker 0 (`eval_encodings`)."""
        return self.engine.eval_images(policy, dataset, pairs, encoded)

    def eval_encodings(self, dataset: str, pairs: list) -> dict | None:
        """The prompt encodings a shard's `eval_images` makes, in host memory (worker 0)."""
        return self.engine.eval_encodings(dataset, pairs)

    def text_tower_bytes(self) -> int:
        """Bytes of text-tower weights this worker holds (0 where worker 0 encodes for it)."""
        from .fsdp import local_bytes

        towers = getattr(self.engine.policy.family, "text_towers", dict)()
        return local_bytes(p for m in towers.values() for p in m.parameters())


class RewardWorker(_Worker):
    kind = "reward"

    def score(self, images, prompts, metadata, sample_ids):
        worker_fault_point(self.kind, self.index)
        return self.engine.score(images, prompts, metadata, sample_ids)

    def score_rows(self, rows, iteration: int) -> tuple[dict, float]:
        """The rewards of rows read from the table (in `rows.sample_ids` order) and the seconds."""
        import time

        from ..artifacts.column_writes import score_columns, score_inputs

        worker_fault_point(self.kind, self.index)
        images, prompts, metadata, sample_ids = score_inputs(rows.read(score_columns(rows.dataset().schema.names)),
                                                             iteration)
        t0 = time.perf_counter()
        scores = self.engine.score(images, prompts, metadata, sample_ids)
        return scores, time.perf_counter() - t0


class TrainerWorker(_Worker):
    kind = "trainer"

    def __init__(self, cfg_json: dict, index: int, threads: int):
        super().__init__(cfg_json, index, threads)
        self.engine.text_towers = not trainer_takes_encodings(self.engine.cfg.model.family)

    def rendezvous(self) -> str:
        """host:port for the group's TCP store: this node's address and a port free on it."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def join(self, world: int, master: str, backend: str, sharding: str = "ddp") -> int:
        from .collective import TorchDistributed

        self.engine.collective = TorchDistributed.join(self.index, world, master, backend,
                                                       sharded=sharding == "fsdp")
        if sharding == "fsdp":
            self.engine.shard()
        return self.index

    def train(self, policy, batch, plan, recipe, seed, reference, prompt_sets, encodings=None, stored=None):
        """Every rank trains; rank 0 returns the new state (the others: None, nothing to move).
        `encodings`: the replay's prompt conditioning (a rank without text towers needs it)."""
        worker_fault_point(self.kind, self.index)
        result = self.engine.train(policy, batch, plan, recipe, seed=seed, reference=reference,
                                   prompt_sets=prompt_sets, encodings=encodings, stored=stored)
        return result if self.index == 0 else None

    def mark(self, checkpoint_id: str) -> None:
        self.engine.mark(checkpoint_id)

    def invalidate(self) -> None:
        self.engine.invalidate()

    def held_bytes(self) -> dict:
        """Bytes of trainable weights and optimizer moments this rank holds (FSDP: its shards), and
        of text towers (none where the rollout's encodings are given)."""
        import torch

        from .fsdp import local_bytes

        pol = self.engine.policy
        moments = [v for s in (pol.optimizer.state.values() if pol.optimizer else []) for v in s.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0]
        towers = getattr(pol.family, "text_towers", dict)()
        return {"weights": local_bytes(pol.trainable_parameters().values()), "moments": local_bytes(moments),
                "text_towers": local_bytes(p for m in towers.values() for p in m.parameters())}

    def trainable_digest(self) -> str:
        """sha256 over the trainable tensors: ranks of one group must agree."""
        import hashlib

        h = hashlib.sha256()
        for name, t in sorted(self.engine.policy.state().items()):
            h.update(name.encode())
            h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()
