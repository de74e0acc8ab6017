"""The trajectory store over many iterations (issue 14): column writes that touch only their
columns, reads that find one iteration's rows, and the maintenance policy (index, cleanup)
that keeps tagged and recent versions readable. Real Lance in tmp_path, small shapes."""

from datetime import timedelta

import duckdb
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pixrl.artifacts.store_maintenance import INDEX_NAME, maintain_store, pin_version
from pixrl.artifacts.trajectories import (
    StoreError,
    TableRef,
    TrajectoryStore,
    rewards_column,
    tensor_column,
    tensor_from,
    trajectory_schema,
)

S, LATENT, T, N = 2, (2, 4, 4), 4, 6
SCHEMA = trajectory_schema(S, LATENT, T)


def _gen(run: str, it: int, n: int = N, latent: tuple[int, int, int] = LATENT) -> pa.Table:
    rng = np.random.default_rng(1000 * it + len(run))
    schema = trajectory_schema(S, latent, T)
    cols = {f.name: pa.nulls(n, f.type) for f in schema}
    cols.update(run_id=pa.array([run] * n), iteration=pa.array([it] * n, pa.int32()),
                sample_id=pa.array([f"{it:05d}-{i:03d}" for i in range(n)]),
                group_id=pa.array([i // 2 for i in range(n)], pa.int32()),
                latents=tensor_column(rng.standard_normal((n, S, *latent), dtype=np.float32)),
                next_latents=tensor_column(rng.standard_normal((n, S, *latent), dtype=np.float32)),
                final_latent=tensor_column(np.full((n, *latent), it, np.float32)))
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


def _keys(t: pa.Table) -> dict:
    return {"run_id": t["run_id"], "iteration": t["iteration"], "sample_id": t["sample_id"]}


def _iteration(st: TrajectoryStore, run: str, it: int, tag: bool = True, **gen) -> dict[str, TableRef]:
    """What the engine does to the store in one iteration; returns each stage's reference."""
    refs = {"generate": st.append(_gen(run, it, **gen))}
    if tag:
        st.tag(f"{run}-it{it}-generate", refs["generate"].version)
    t = st.read(refs["generate"], run, it, ["run_id", "iteration", "sample_id", "final_latent"])
    imgs = pa.array([f"png-{run}-{it}-{s}".encode() for s in t["sample_id"].to_pylist()], pa.binary())
    refs["decode"] = st.merge(pa.table({**_keys(t), "image": imgs}))
    n = t.num_rows
    reward = pa.array(np.arange(n, dtype=np.float32) + it, pa.float32())
    refs["score"] = st.merge(pa.table({**_keys(t), "rewards": rewards_column({"a": reward.to_numpy()}, n),
                                       "reward": reward}))
    refs["replay"] = st.merge(pa.table({**_keys(t), "advantage": pc.negate(reward)}))
    return refs


def _check_rows(st: TrajectoryStore, ref: TableRef, run: str, it: int, stage: str = "replay") -> None:
    t = st.read(ref, run, it, ["run_id", "iteration", "sample_id", "final_latent", "image", "reward", "advantage"])
    assert t.num_rows == N
    assert set(t["run_id"].to_pylist()) == {run} and set(t["iteration"].to_pylist()) == {it}
    assert t["sample_id"].to_pylist() == [f"{it:05d}-{i:03d}" for i in range(N)]
    assert np.all(tensor_from(t["final_latent"]) == it)
    filled = {"generate": 0, "decode": 1, "score": 2, "replay": 3}[stage]
    assert (t["image"].null_count == 0) == (filled >= 1)
    if filled >= 1:
        assert t["image"].to_pylist() == [f"png-{run}-{it}-{s}".encode() for s in t["sample_id"].to_pylist()]
    assert (t["reward"].null_count == 0) == (filled >= 2)
    if filled >= 3:
        assert t["advantage"].to_pylist() == [-(i + it) for i in range(N)]


def test_each_stage_write_is_one_version_and_touches_only_its_columns(tmp_path):
    st = TrajectoryStore(str(tmp_path / "t.lance"))
    refs = _iteration(st, "r", 0)
    assert [refs[s].version for s in ("generate", "decode", "score", "replay")] == [1, 2, 3, 4]
    files = {f.path for f in st.dataset().get_fragments()[0].data_files()}
    assert len(files) == 4  # generate's file (latents written once) + one small file per column write
    gen_file = st.dataset(1).get_fragments()[0].data_files()[0].path
    assert gen_file in files
    for stage, ref in refs.items():  # every stage's version still reads as it was written
        _check_rows(st, ref, "r", 0, stage)


def test_read_returns_exactly_the_iterations_rows_after_many_iterations(tmp_path):
    st = TrajectoryStore(str(tmp_path / "t.lance"))
    refs = {}
    for it in range(24):
        for run in ("run-a", "run-b"):  # two runs in one table: the key is (run_id, iteration)
            refs[run, it] = _iteration(st, run, it)
        if it % 5 == 4:  # some fragments indexed, the latest ones not
            maintain_store(st, keep_versions=1000, older_than=timedelta(0))
    assert st.dataset().stats.index_stats(INDEX_NAME)["num_unindexed_fragments"] > 0
    latest = TableRef(st.uri, st.latest_version())
    for it in (0, 7, 19, 23):
        for run in ("run-a", "run-b"):
            _check_rows(st, latest, run, it)
            _check_rows(st, refs[run, it]["generate"], run, it, "generate")
            _check_rows(st, refs[run, it]["score"], run, it, "score")
            assert st.count(run, it) == N
            assert st.count(run, it, where="image IS NOT NULL") == N
            assert st.count(run, it, version=refs[run, it]["generate"].version, where="image IS NOT NULL") == 0
    assert st.count("run-a", 24) == 0 and st.count("run-c", 3) == 0
    assert st.read(latest, "run-a", 99, ["sample_id", "image"]).num_rows == 0
    assert st.count("it's", 1) == 0  # a quote in a run id is a literal, not SQL


def test_merge_after_maintenance_is_one_version_and_tagged_versions_stay_readable(tmp_path):
    st = TrajectoryStore(str(tmp_path / "t.lance"))
    for it in range(6):
        _iteration(st, "r", it)
        maintain_store(st, keep_versions=3, older_than=timedelta(0))
    ds = st.dataset()
    kept = sorted(v["version"] for v in ds.versions())
    tagged = sorted(ds.tags.get_version(f"r-it{it}-generate") for it in range(6))
    latest = ds.version
    assert set(tagged) <= set(kept)
    assert set(kept) - set(tagged) == set(range(latest - 2, latest + 1)) - set(tagged)  # newest 3 + the tags
    for it in range(6):  # a tag still reads the iteration as generate wrote it (image not yet there)
        _check_rows(st, TableRef(st.uri, tagged[it]), "r", it, "generate")
        _check_rows(st, TableRef(st.uri, latest), "r", it)
    refs = _iteration(st, "r", 6)
    assert [refs[s].version for s in ("generate", "decode", "score", "replay")] == list(range(latest + 1, latest + 5))
    t = st.read(refs["replay"], "r", 6, ["run_id", "iteration", "sample_id"])
    before = st.latest_version()
    out = st.merge(pa.table({**_keys(t), "advantage": pa.array([7.0] * N, pa.float32())}))  # a rerun of replay
    assert out.version == before + 1 == st.latest_version()
    assert st.read(out, "r", 6, ["advantage"])["advantage"].to_pylist() == [7.0] * N
    assert st.read(refs["replay"], "r", 6, ["advantage"])["advantage"].to_pylist() == [-(i + 6) for i in range(N)]
    report = maintain_store(st, keep_versions=2, older_than=timedelta(0))
    assert report.index == "updated" and report.versions_removed > 0
    _check_rows(st, TableRef(st.uri, st.dataset().tags.get_version("r-it6-generate")), "r", 6, "generate")
    # plain lance / duckdb, no pixrl: the table is an ordinary Lance table
    plain = lance.dataset(st.uri)
    assert plain.count_rows() == 7 * N
    assert duckdb.sql("SELECT count(*) FROM plain WHERE image IS NOT NULL AND advantage IS NOT NULL").fetchall()[0][0] == 7 * N


def test_a_failed_merge_or_append_leaves_no_new_version(tmp_path):
    st = TrajectoryStore(str(tmp_path / "t.lance"))
    _iteration(st, "r", 0)
    _iteration(st, "r", 1)
    maintain_store(st, keep_versions=100, older_than=timedelta(0))
    st.append(_gen("r", 2))
    v = st.latest_version()
    keys = _keys(st.read(TableRef(st.uri, v), "r", 2, ["run_id", "iteration", "sample_id"]))
    img = pa.array([b"x"] * N, pa.binary())
    bad = {
        "holds": pa.table({k: c[:N - 1] for k, c in keys.items()} | {"image": img[:N - 1]}),
        "lacks rows": pa.table({**keys, "sample_id": pa.array([f"zz-{i}" for i in range(N)]), "image": img}),
        "repeats a sample_id": pa.table({**keys, "sample_id": pa.array(["00002-000"] * N), "image": img}),
        "unknown": pa.table({**keys, "not_a_column": img}),
        "do not fit": pa.table({**keys, "reward": pa.array(["high"] * N)}),
        "exactly one": pa.table({**keys, "iteration": pa.array([2] * (N - 1) + [1], pa.int32()), "image": img}),
    }
    for match, table in bad.items():
        with pytest.raises(StoreError, match=match):
            st.merge(table)
        assert st.latest_version() == v, match
    with pytest.raises(StoreError, match="holds 0"):  # never inserts
        st.merge(pa.table({**_keys(_gen("r", 5)), "image": img}))
    with pytest.raises(StoreError, match="refusing to overwrite"):
        st.append(_gen("r", 1))
    assert st.latest_version() == v
    assert st.read(TableRef(st.uri, v), "r", 2, ["image"])["image"].null_count == N


def test_merge_into_fragments_that_hold_several_iterations(tmp_path):
    """Someone compacts the table with plain Lance: a fragment then holds several iterations,
    and a column write must change only its own iteration's rows."""
    st = TrajectoryStore(str(tmp_path / "t.lance"))
    for it in range(3):
        _iteration(st, "r", it)
    st.append(_gen("r", 3))
    st.dataset().optimize.compact_files(target_rows_per_fragment=10_000)
    assert len(st.dataset().get_fragments()) == 1
    t = st.read(TableRef(st.uri, st.latest_version()), "r", 3, ["run_id", "iteration", "sample_id"])
    v = st.latest_version()
    out = st.merge(pa.table({**_keys(t), "image": pa.array([f"png-r-3-{s}".encode() for s in t["sample_id"].to_pylist()])}))
    assert out.version == v + 1
    _check_rows(st, out, "r", 3, "decode")
    for it in range(3):
        _check_rows(st, out, "r", it)


def test_bytes_on_disk_stay_near_the_payload(tmp_path):
    """The default recipe's rows at a quarter of the count: 32 rows, latents 2×[4,8,8] f32."""
    st = TrajectoryStore(str(tmp_path / "t.lance"))
    for it in range(12):
        _iteration(st, "r", it, n=32, latent=(4, 8, 8))
        maintain_store(st, keep_versions=8, older_than=timedelta(0))
    on_disk = sum(f.stat().st_size for f in (tmp_path / "t.lance").rglob("*") if f.is_file())
    payload = st.read(TableRef(st.uri, st.latest_version()), "r", 0, st.dataset().schema.names).nbytes * 12
    assert on_disk < 1.3 * payload  # merge_insert wrote each row's latents four times: 4×


def test_maintenance_policy_schedule_recent_versions_and_pins(tmp_path):
    st = TrajectoryStore(str(tmp_path / "t.lance"))
    assert maintain_store(st).version_after is None  # no table yet: nothing to do
    refs = {it: _iteration(st, "r", it, tag=False) for it in range(3)}
    assert maintain_store(st, 0, every=2) is None  # iterations 1, 3, 5, ... maintain
    assert pin_version(st, refs[0]["score"].version, "dpo-source") == "pin-dpo-source"
    young = maintain_store(st, 1, every=2, keep_versions=1)  # default older_than: nothing is old enough yet
    assert young.index == "created" and young.versions_removed == 0
    v = st.latest_version()
    report = maintain_store(st, keep_versions=2, older_than=timedelta(0))
    assert report.index == "current" and report.version_after == v  # nothing to index: no commit
    kept = {x["version"] for x in st.dataset().versions()}
    assert kept == {v - 1, v, refs[0]["score"].version}
    _check_rows(st, refs[0]["score"], "r", 0, "score")
    _check_rows(st, refs[2]["replay"], "r", 2)
    with pytest.raises(ValueError):
        maintain_store(st, keep_versions=0)
