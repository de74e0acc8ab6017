"""The Lance `trajectories` table: one row per sample, key (run_id, iteration, sample_id).

generate appends the rows (one Lance version); decode, score and replay fill their columns
with one merge_insert each (one version each). Every write is a single atomic commit; a stage
validates everything before it writes, so a failure leaves no new version. The schema is
documented in docs/trajectories.md and readable with plain lance/pyarrow or duckdb.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

KEY = ["run_id", "iteration", "sample_id"]
REWARD_ITEM = pa.struct([pa.field("name", pa.string()), pa.field("value", pa.float32())])


def trajectory_schema(stored_steps: int, latent_shape: tuple[int, int, int], total_steps: int) -> pa.Schema:
    c, h, w = latent_shape
    s = stored_steps
    return pa.schema([
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string()),
        pa.field("prompt", pa.string()),
        pa.field("prompt_meta", pa.string()),  # JSON
        pa.field("group_id", pa.int32()),
        pa.field("sample_index", pa.int32()),
        pa.field("seed", pa.int64()),
        pa.field("policy_version", pa.int32()),
        pa.field("family", pa.string()),
        pa.field("regime", pa.string()),
        pa.field("step_kind", pa.string()),
        pa.field("recipe", pa.string()),  # JSON: sampler, steps, noise level, window, cfg, dtype, engine
        pa.field("timesteps", pa.list_(pa.float32(), total_steps)),
        pa.field("sigmas", pa.list_(pa.float32(), total_steps + 1)),
        pa.field("stored_steps", pa.list_(pa.int32(), s)),
        pa.field("latents", pa.fixed_shape_tensor(pa.float32(), [s, c, h, w])),
        pa.field("next_latents", pa.fixed_shape_tensor(pa.float32(), [s, c, h, w])),
        pa.field("log_probs", pa.list_(pa.float32(), s)),
        pa.field("final_latent", pa.fixed_shape_tensor(pa.float32(), [c, h, w])),
        pa.field("image", pa.binary()),  # PNG, filled by decode
        pa.field("rewards", pa.list_(REWARD_ITEM)),  # per component, filled by score
        pa.field("reward", pa.float32()),  # weighted total, filled by score
        pa.field("advantage", pa.float32()),  # filled by replay
    ])


@dataclass(frozen=True)
class TableRef:
    """A immutable pointer to one version of a Lance table (what tasks pass to each other)."""

    uri: str
    version: int

    def to_dict(self) -> dict:
        return {"uri": self.uri, "version": self.version}


class StoreError(RuntimeError):
    pass


class TrajectoryStore:
    def __init__(self, uri: str):
        self.uri = uri

    def exists(self) -> bool:
        try:
            lance.dataset(self.uri)
            return True
        except (ValueError, FileNotFoundError, OSError):
            return False

    def dataset(self, version: int | None = None) -> lance.LanceDataset:
        return lance.dataset(self.uri, version=version)

    def latest_version(self) -> int | None:
        return self.dataset().version if self.exists() else None

    def count(self, run_id: str, iteration: int, version: int | None = None, where: str | None = None) -> int:
        if not self.exists():
            return 0
        f = f"run_id = '{run_id}' AND iteration = {int(iteration)}" + (f" AND ({where})" if where else "")
        return self.dataset(version).count_rows(filter=f)

    def append(self, table: pa.Table) -> TableRef:
        """Append one iteration's rows; refuses to add a (run_id, iteration) that is already there."""
        runs = pc.unique(table["run_id"]).to_pylist()
        its = pc.unique(table["iteration"]).to_pylist()
        if len(runs) != 1 or len(its) != 1:
            raise StoreError("append takes the rows of exactly one (run_id, iteration)")
        if self.count(runs[0], its[0]):
            raise StoreError(f"{self.uri} already holds rows for run {runs[0]!r} iteration {its[0]}; "
                             f"refusing to overwrite (resume skips complete stages instead)")
        if self.exists():
            ds = lance.write_dataset(table, self.uri, mode="append")
        else:
            ds = lance.write_dataset(table, self.uri, schema=table.schema, mode="create")
        return TableRef(self.uri, ds.version)

    def merge(self, table: pa.Table) -> TableRef:
        """Fill columns of existing rows, matched on the key; never inserts rows."""
        ds = self.dataset()
        run, it = table["run_id"][0].as_py(), table["iteration"][0].as_py()
        have = self.count(run, it)
        if have != table.num_rows:
            raise StoreError(f"merge of {table.num_rows} rows into run {run!r} iteration {it}, which holds {have}")
        ds.merge_insert(KEY).when_matched_update_all().execute(table)
        return TableRef(self.uri, self.dataset().version)

    def read(self, ref: TableRef, run_id: str, iteration: int, columns: list[str]) -> pa.Table:
        cols = columns if "sample_id" in columns else ["sample_id", *columns]
        t = self.dataset(ref.version).to_table(
            columns=cols, filter=f"run_id = '{run_id}' AND iteration = {int(iteration)}")
        return t.sort_by("sample_id").select(columns)

    def tag(self, name: str, version: int) -> None:
        ds = self.dataset()
        if name in ds.tags.list():
            ds.tags.update(name, version)
        else:
            ds.tags.create(name, version)


def tensor_column(arr: np.ndarray) -> pa.Array:
    return pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(arr, dtype=np.float32))


def tensor_from(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    return col.to_numpy_ndarray()


def fixed_list(values: np.ndarray, size: int, dtype=pa.float32()) -> pa.Array:
    flat = pa.array(np.asarray(values).reshape(-1), type=dtype)
    return pa.FixedSizeListArray.from_arrays(flat, size)


def rewards_column(components: dict[str, np.ndarray], n: int) -> pa.Array:
    names = sorted(k for k in components if k != "reward")
    return pa.array([[{"name": k, "value": float(components[k][i])} for k in names] for i in range(n)],
                    type=pa.list_(REWARD_ITEM))


def meta_json(meta: dict) -> str:
    return json.dumps(meta, sort_keys=True)
