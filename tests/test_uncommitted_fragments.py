"""Fragments no version will list — a rollout begun ahead that no stage takes, a distributed
generate that fails between its workers' writes and its commit — have their files deleted then,
instead of waiting out Lance's 7-day cleanup (artifacts/rollout_rows.discard_fragments). Real
Lance tables and fragments in a tmp dir (the generate case: tests/test_ray_engine.py -k
fails_before_its_commit)."""

from __future__ import annotations

import threading
from pathlib import Path

import lance
import pyarrow as pa
import pytest

from pixrl.artifacts.rollout_rows import discard_fragments
from pixrl.stages.rollout_prefetch import RolloutPrefetch

SCHEMA = pa.schema([("a", pa.int64())])


def _files(uri: str) -> set[str]:
    return {p.name for p in (Path(uri) / "data").iterdir()}


def _table(tmp_path: Path) -> str:
    uri = str(tmp_path / "t.lance")
    lance.write_dataset(pa.table({"a": [1, 2]}, schema=SCHEMA), uri)
    return uri


def _write(uri: str, values: list[int]) -> list:
    return lance.fragment.write_fragments(pa.table({"a": values}, schema=SCHEMA), uri, schema=SCHEMA)


def test_discard_deletes_only_the_uncommitted_files(tmp_path):
    uri = _table(tmp_path)
    committed = _files(uri)
    stray = _write(uri, [3, 4])
    assert _files(uri) > committed
    assert discard_fragments(uri, stray) == 1 and discard_fragments(uri, stray) == 0  # once
    assert _files(uri) == committed and lance.dataset(uri).to_table()["a"].to_pylist() == [1, 2]


def test_a_prefetch_no_stage_takes_is_discarded_when_it_finishes(tmp_path):
    uri = _table(tmp_path)
    committed = _files(uri)
    gate = threading.Event()
    prefetch = RolloutPrefetch()

    def slow():
        gate.wait(10)
        return (_write(uri, [5]),)

    prefetch.begin((1, "m", 0), slow, discard=lambda res: discard_fragments(uri, res[0]))
    prefetch.begin((2, "m", 0), lambda: (_write(uri, [6]),), discard=lambda res: discard_fragments(uri, res[0]))
    taken = prefetch.take((2, "m", 0))  # the second is taken: its fragments are the stage's to commit
    gate.set()  # the first, replaced while running, finishes now
    prefetch.close()
    assert _files(uri) == committed | {d.path for f in taken[0] for d in f.files}
    ahead = RolloutPrefetch()
    ahead.begin((3, "m", 0), lambda: (_write(uri, [7]),), discard=lambda res: discard_fragments(uri, res[0]))
    ahead.close()  # the run ends before iteration 3's generate
    assert _files(uri) == committed | {d.path for f in taken[0] for d in f.files}
    failing = RolloutPrefetch()
    failing.begin((4, "m", 0), lambda: 1 / 0, discard=lambda res: pytest.fail("a failed prefetch wrote nothing"))
    failing.close()


def test_a_decode_that_will_not_commit_deletes_only_the_column_files_it_wrote(tmp_path):
    """A worker's decode writes the image columns of a fragment as new data files of it
    (`RowsRead.write_columns`); discarding them (a peer failed: the stage will not commit) leaves
    the fragment's own files, and the table reads as before."""
    from pixrl.artifacts.column_writes import RowsRead, discard_column_files

    uri = _table(tmp_path)
    lance.dataset(uri).add_columns({"image": "CAST(NULL AS BINARY)"})  # decode fills a column the table has
    ds = lance.dataset(uri)
    committed = _files(uri)
    read = RowsRead(uri, ds.version, "a >= 0", fragment_id=ds.get_fragments()[0].fragment_id, rows=2)
    rows = read.read(["a"])
    written = read.write_columns(pa.table({"_rowid": rows["_rowid"], "image": pa.array([b"x", b"y"], pa.binary())}))
    assert _files(uri) > committed
    other = RowsRead(uri, ds.version, "a >= 0", fragment_id=99, rows=0)  # a read whose fragment wrote nothing
    assert discard_column_files([read, other], [written]) >= 1 and discard_column_files([read], [written]) == 0
    assert _files(uri) == committed
    assert lance.dataset(uri).to_table(columns=["a", "image"]).to_pylist() == [{"a": 1, "image": None},
                                                                               {"a": 2, "image": None}]
