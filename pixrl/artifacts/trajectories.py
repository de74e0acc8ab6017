"""The Lance `trajectories` table: one row per sample, key (run_id, iteration, sample_id).

generate appends the rows (one Lance version, one fragment per iteration); decode, score and
replay fill their columns with one commit each (one version each). Every write is a single
atomic commit; a stage validates everything before it writes, so a failure leaves no new
version. The schema is documented in docs/trajectories.md and readable with plain
lance/pyarrow or duckdb.

How a stage stays (nearly) independent of the table's history (issue 14; the measurements,
the choice and the compaction/cleanup policy are in `store_maintenance`):
- a column write (`merge`) attaches a new data file holding only the written columns to the
  fragment that holds the iteration's rows (Lance `LanceFragment.update_columns`, committed as
  one `Update` in `rewrite_columns` mode). The latents are written once, by generate, and never
  copied: `merge_insert` rewrote whole rows (4 copies of the payload per iteration, 3.8× the
  payload on disk) and joined the update against every row of the table.
- reads and counts filter on (run_id, iteration); the BITMAP index on `iteration` that
  `store_maintenance.maintain_store` keeps up to date answers the filter, and only fragments
  appended since its last update are scanned. Without it every stage scanned the whole table.
- one `lance.Session` per store caches manifests and index pages across its opens (a version
  never changes once written).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .batch import REWARD_ITEM, schema
from .column_writes import ColumnFile, RowsRead
from .rollout_rows import commit_fragments

KEY = ["run_id", "iteration", "sample_id"]
def trajectory_schema(stored_steps: int, latent_shape: tuple[int, ...], total_steps: int,
                      optional: tuple[str, ...] = ()) -> pa.Schema:
    """The table's schema for a run's dimensions, from the one field spec (artifacts/batch.py)."""
    return schema({"S": stored_steps, "T": total_steps, "T1": total_steps + 1, "latent": tuple(latent_shape)},
                  optional)


@dataclass(frozen=True)
class TableRef:
    """A immutable pointer to one version of a Lance table (what tasks pass to each other)."""

    uri: str
    version: int

    def to_dict(self) -> dict:
        return {"uri": self.uri, "version": self.version}


class StoreError(RuntimeError):
    pass


def _sql_str(value: str) -> str:
    return "'" + str(value).replace("'", "''") + "'"


def key_filter(run_id: str, iteration: int) -> str:
    return f"run_id = {_sql_str(run_id)} AND iteration = {int(iteration)}"


class TrajectoryStore:
    def __init__(self, uri: str):
        self.uri = uri
        self._session: lance.Session | None = None

    @property
    def session(self) -> lance.Session:
        """Lance caches (manifests, index pages, file footers) shared by this store's opens: a
        version is immutable, so a reopen reads nothing already read (3.9 → 0.4 ms to open the
        latest version of a 300-iteration table)."""
        if self._session is None:
            self._session = lance.Session()
        return self._session

    def __getstate__(self) -> dict:  # a store travels as its uri; caches stay in the process
        return {"uri": self.uri, "_session": None}

    def exists(self) -> bool:
        try:
            self.dataset()
            return True
        except (ValueError, FileNotFoundError, OSError):
            return False

    def dataset(self, version: int | None = None) -> lance.LanceDataset:
        return lance.dataset(self.uri, version=version, session=self.session)

    def latest_version(self) -> int | None:
        return self.dataset().version if self.exists() else None

    def count(self, run_id: str, iteration: int, version: int | None = None, where: str | None = None) -> int:
        try:
            ds = self.dataset(version)
        except (ValueError, FileNotFoundError, OSError):
            if version is None or not self.exists():
                return 0  # no table yet
            raise
        f = key_filter(run_id, iteration) + (f" AND ({where})" if where else "")
        return ds.count_rows(filter=f)

    def append(self, table: pa.Table, where: str | None = None) -> TableRef:
        """Append one iteration's rows; refuses to add a (run_id, iteration) that is already there
        (with `where`: rows of it matching `where`, e.g. one sampling round's groups)."""
        run, it = _one_key(table, "append")
        self.ensure_absent(run, it, where)
        if self.exists():
            ds = lance.write_dataset(table, self.uri, mode="append")
        else:
            ds = lance.write_dataset(table, self.uri, schema=table.schema, mode="create")
        return TableRef(self.uri, ds.version)

    def ensure_absent(self, run: str, it: int, where: str | None = None) -> None:
        """Refuse to add rows of a (run_id, iteration) [matching `where`] that the table holds."""
        if self.count(run, it, where=where):
            raise StoreError(f"{self.uri} already holds rows for run {run!r} iteration {it}"
                             + (f" where {where}" if where else "")
                             + "; refusing to overwrite (resume skips complete stages instead)")

    def commit_appended(self, fragments: list, schema: pa.Schema, create: bool, run: str, it: int,
                        where: str | None = None) -> TableRef:
        """Commit fragments that workers wrote (artifacts/rollout_rows.py) as one new version."""
        self.ensure_absent(run, it, where)
        return TableRef(self.uri, commit_fragments(self.uri, fragments, schema, create))

    def merge(self, table: pa.Table, where: str | None = None) -> TableRef:
        """Fill columns of existing rows, matched on the key; never inserts rows. `table` holds
        every row of the iteration, or with `where` every row of it that matches `where`.

        One commit that attaches a data file with just these columns to each fragment holding
        the iteration's rows; the other columns are neither read nor rewritten."""
        ds = self.dataset()
        run, it = _one_key(table, "merge")
        missing = [k for k in KEY if k not in table.column_names]
        cols = [c for c in table.column_names if c not in KEY]
        unknown = [c for c in cols if c not in ds.schema.names]
        if missing or not cols or unknown:
            raise StoreError(f"merge takes the key columns {KEY} and at least one existing column; "
                             f"missing {missing}, unknown {unknown}")
        sample_ids = pc.cast(table["sample_id"], pa.string())
        if pc.count_distinct(sample_ids).as_py() != table.num_rows:
            raise StoreError(f"merge into run {run!r} iteration {it} repeats a sample_id")
        scope = key_filter(run, it) + (f" AND ({where})" if where else "")
        addrs = self._row_addresses(ds, scope)
        if len(addrs) != table.num_rows:
            raise StoreError(f"merge of {table.num_rows} rows into run {run!r} iteration {it}"
                             + (f" where {where}" if where else "") + f", which holds {len(addrs)}")
        try:
            values = table.select(cols).cast(pa.schema([ds.schema.field(c) for c in cols]))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as e:
            raise StoreError(f"merge columns {cols} do not fit the table's types: {e}") from e
        plans = []
        for frag in self._fragments(ds, addrs):
            keys = frag.to_table(columns=["sample_id"], filter=scope, with_row_id=True)
            pos = pc.index_in(keys["sample_id"], value_set=sample_ids)
            if pos.null_count:
                absent = keys.filter(pc.is_null(pos))["sample_id"].to_pylist()
                raise StoreError(f"merge into run {run!r} iteration {it} lacks rows for stored samples {absent[:3]}")
            plans.append((frag, values.take(pos).append_column("_rowid", keys["_rowid"])))
        updated, fields = [], set()
        for frag, rows in plans:  # writes uncommitted data files; nothing is visible before the commit
            meta, modified = frag.update_columns(rows, left_on="_rowid")
            updated.append(meta)
            fields.update(modified)
        return self._commit_update(ds, updated, fields)

    def _commit_update(self, ds: lance.LanceDataset, updated: list, fields) -> TableRef:
        """One `Update` commit of column files attached to fragments of `ds`'s version."""
        op = lance.LanceOperation.Update(updated_fragments=updated, fields_modified=sorted(fields),
                                         update_mode="rewrite_columns")
        return TableRef(self.uri, lance.LanceDataset.commit(ds, op, read_version=ds.version).version)

    # --- column writes by workers (artifacts/column_writes.py) ---------------------------------
    def fragment_reads(self, ref: TableRef, run_id: str, iteration: int, where: str | None = None) -> list[RowsRead]:
        """One `RowsRead` per fragment holding rows of the iteration [matching `where`], in
        fragment order, each with its row count."""
        scope = key_filter(run_id, iteration) + (f" AND ({where})" if where else "")
        addrs = self._row_addresses(self.dataset(ref.version), scope)
        if not len(addrs):
            raise StoreError(f"{self.uri}@{ref.version} holds no rows of run {run_id!r} iteration {iteration}"
                             + (f" where {where}" if where else ""))
        ids, counts = np.unique(np.asarray(addrs, dtype=np.uint64) >> np.uint64(32), return_counts=True)
        return [RowsRead(self.uri, ref.version, scope, int(i), int(n)) for i, n in zip(ids, counts)]

    def rows_read(self, ref: TableRef, run_id: str, iteration: int, sample_ids: list[str],
                  where: str | None = None) -> RowsRead:
        """The rows of these samples of the iteration [matching `where`], for a worker to read."""
        scope = key_filter(run_id, iteration) + (f" AND ({where})" if where else "")
        return RowsRead(self.uri, ref.version, scope, sample_ids=tuple(sample_ids))

    def commit_columns(self, reads: list[RowsRead], files: list[ColumnFile]) -> TableRef:
        """Commit the column files workers wrote for `reads` (one per fragment, every row of each,
        the same columns) as one new version."""
        by_fragment = {f.fragment_id: f for f in files}
        for r in reads:
            f = by_fragment.get(r.fragment_id)
            if f is None or f.rows != r.rows:
                raise StoreError(f"column write to {self.uri}: fragment {r.fragment_id} holds {r.rows} rows of "
                                 f"{r.scope!r}, its worker wrote {0 if f is None else f.rows}; nothing committed")
        if len(by_fragment) != len(files) or set(by_fragment) != {r.fragment_id for r in reads} \
                or len({f.fields for f in files}) != 1:
            raise StoreError(f"column write to {self.uri}: files {[(f.fragment_id, f.fields) for f in files]} do not "
                             f"cover fragments {[r.fragment_id for r in reads]} once each with the same columns")
        ds = self.dataset(reads[0].version)
        return self._commit_update(ds, [f.metadata for f in files], files[0].fields)

    def read(self, ref: TableRef, run_id: str, iteration: int, columns: list[str], where: str | None = None) -> pa.Table:
        cols = columns if "sample_id" in columns else ["sample_id", *columns]
        f = key_filter(run_id, iteration) + (f" AND ({where})" if where else "")
        t = self.dataset(ref.version).to_table(columns=cols, filter=f)
        return t.sort_by("sample_id").select(columns)

    def earlier(self, version: int | None, run_id: str, iteration: int, columns: list[str]) -> pa.Table:
        """`columns` of the run's rows of every iteration before `iteration` at table `version`,
        oldest first (iteration, then sample id): the past an advantage with memory reads."""
        cols = list(dict.fromkeys([*columns, "iteration", "sample_id"]))
        f = f"run_id = {_sql_str(run_id)} AND iteration < {int(iteration)}"
        t = self.dataset(version).to_table(columns=cols, filter=f)
        return t.sort_by([("iteration", "ascending"), ("sample_id", "ascending")]).select(columns)

    def tag(self, name: str, version: int) -> None:
        tags = self.dataset().tags
        try:
            tags.create(name, version)
        except (ValueError, OSError):
            if name not in tags.list():
                raise
            tags.update(name, version)

    # --- locating one iteration's rows ---------------------------------------------------------
    @staticmethod
    def _row_addresses(ds: lance.LanceDataset, scope: str) -> pa.Array:
        """Row addresses of the rows `scope` (a filter on one run's iteration) selects."""
        t = ds.to_table(columns=[], filter=scope, with_row_address=True)
        return t["_rowaddr"].combine_chunks()

    @staticmethod
    def _fragments(ds: lance.LanceDataset, addrs: pa.Array) -> list:
        ids = pc.unique(pc.shift_right(addrs, pa.scalar(32, pa.uint64()))).to_pylist()
        return [ds.get_fragment(int(i)) for i in sorted(ids)]


def _one_key(table: pa.Table, what: str) -> tuple[str, int]:
    if table.num_rows == 0 or "run_id" not in table.column_names or "iteration" not in table.column_names:
        raise StoreError(f"{what} takes the rows of exactly one (run_id, iteration); got no keyed rows")
    runs = pc.unique(table["run_id"]).to_pylist()
    its = pc.unique(table["iteration"]).to_pylist()
    if len(runs) != 1 or len(its) != 1 or runs[0] is None or its[0] is None:
        raise StoreError(f"{what} takes the rows of exactly one (run_id, iteration)")
    return runs[0], int(its[0])


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
    """Each sample's stored scores, by name. NaN marks a reward that did not score the sample (per-task
    rewards, rewards/routing.py — a scorer's own NaN is refused before this): it has no entry."""
    names = sorted(k for k in components if k != "reward")
    return pa.array([[{"name": k, "value": float(components[k][i])} for k in names if not np.isnan(components[k][i])]
                     for i in range(n)], type=pa.list_(REWARD_ITEM))


def meta_json(meta: dict) -> str:
    return json.dumps(meta, sort_keys=True)
