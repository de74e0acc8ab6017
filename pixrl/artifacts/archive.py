"""Archived rollouts as a dataset: resolve sources (run names, an MLflow experiment, or a Lance
table path with @version) to Lance tables pinned at one version each, then select rows by
run, iteration range, policy version, reward thresholds and prompt category.

Pinning is what makes an offline run reproducible: rows appended to a source after the pinned
version are never read (Lance time travel).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import lance
import numpy as np
import pyarrow as pa

from ..errors import ExpectedError
from .tracking import Tracker

SELECT_COLUMNS = ["run_id", "iteration", "sample_id", "group_id", "prompt", "prompt_meta", "policy_version",
                  "reward", "rewards", "recipe"]  # recipe: the guidance a distilled family's pairs train at
OPTIONAL_SELECT = ["source_image"]  # an editing rollout's source image: what its pairs are conditioned on


class ArchiveError(ExpectedError, ValueError):
    pass


@dataclass(frozen=True)
class PinnedTable:
    uri: str
    version: int
    run_ids: tuple[str, ...] | None  # None: every run in the table

    @property
    def ref(self) -> str:
        return f"{self.uri}@{self.version}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PinnedTable":
        return cls(d["uri"], int(d["version"]), tuple(d["run_ids"]) if d.get("run_ids") is not None else None)


def _latest(uri: str) -> int:
    try:
        return lance.dataset(uri).version
    except (ValueError, FileNotFoundError, OSError) as exc:
        raise ArchiveError(f"no Lance table at {uri!r} ({exc})") from None


def resolve_sources(sources: list[str], tracker: Tracker) -> list[PinnedTable]:
    """Each source → a table pinned at its current (or the given) version."""
    if not sources:
        raise ArchiveError("no source given: pass --from RUN_NAME, --from experiment:NAME or --from PATH.lance[@version]")
    by_table: dict[str, set[str] | None] = {}
    pinned: dict[str, int] = {}
    for src in sources:
        if ".lance" in src:
            uri, _, v = src.partition("@")
            version = int(v) if v else _latest(uri)
            try:
                lance.dataset(uri, version=version)
            except (ValueError, FileNotFoundError, OSError) as exc:
                raise ArchiveError(f"cannot open {uri!r} at version {version}: {exc}") from None
            if uri in pinned and pinned[uri] != version:
                raise ArchiveError(f"{uri} is named at two versions ({pinned[uri]} and {version})")
            pinned[uri] = version
            by_table[uri] = None
            continue
        if src.startswith("experiment:"):
            name = src.split(":", 1)[1]
            exp = tracker.client.get_experiment_by_name(name)
            if exp is None:
                raise ArchiveError(f"no MLflow experiment named {name!r}")
            runs = tracker.client.search_runs([exp.experiment_id], filter_string="tags.`pixrl.table_uri` != ''")
            if not runs:
                raise ArchiveError(f"experiment {name!r} has no pixrl runs with a trajectory table")
            found = [(r.data.tags["pixrl.table_uri"], r.info.run_id) for r in runs]
        else:
            run_id = tracker.find_run("pixrl.run_name", src)
            if run_id is None:
                raise ArchiveError(f"no run named {src!r}; pass run names, experiment:NAME or PATH.lance[@version]")
            tags = tracker.client.get_run(run_id).data.tags
            if "pixrl.table_uri" not in tags:
                raise ArchiveError(f"run {src!r} ({run_id}) has no trajectory table (not an online RL run)")
            found = [(tags["pixrl.table_uri"], run_id)]
        for uri, run_id in found:
            if by_table.get(uri, set()) is None:
                continue  # the whole table is already selected
            by_table.setdefault(uri, set()).add(run_id)
            pinned.setdefault(uri, _latest(uri))
    return [PinnedTable(uri, pinned[uri], tuple(sorted(ids)) if ids is not None else None)
            for uri, ids in sorted(by_table.items())]


def _where(t: PinnedTable, f) -> str:
    parts = ["reward IS NOT NULL"]
    if t.run_ids is not None:
        parts.append("run_id IN (" + ", ".join(f"'{r}'" for r in t.run_ids) + ")")
    if f.iteration_range is not None:
        lo, hi = f.iteration_range
        parts.append(f"iteration >= {int(lo)} AND iteration < {int(hi)}")
    if f.policy_versions is not None:
        parts.append("policy_version IN (" + ", ".join(str(int(v)) for v in f.policy_versions) + ")")
    return " AND ".join(parts)


def component_value(rewards: list, name: str) -> float:
    """One named reward component of a scored row."""
    for item in rewards or []:
        if item["name"] == name:
            return item["value"]
    raise ArchiveError(f"{name!r} is not a reward these rollouts were scored with (they have "
                       f"{['reward', *(i['name'] for i in rewards or [])]}); use one of those in the reward "
                       f"filters or dpo.pair_on")


def component_values(rows_rewards: list, name: str, metas: list[str] | None) -> np.ndarray:
    """A named component of every row. Rows scored by per-task rewards (reward.tasks) store a reward
    on its task's rows only: a component some rows lack is refused, naming the categories that have it."""
    have = [any(i["name"] == name for i in r or []) for r in rows_rewards]
    if all(have) or not any(have):
        return np.array([component_value(r, name) for r in rows_rewards], dtype=np.float64)
    cats = sorted({str(json.loads(m).get("category")) for m, h in zip(metas or [], have) if h}) or ["…"]
    raise ArchiveError(f"{name!r} is stored by {sum(have)} of the {len(have)} selected rows (per-task rewards score "
                       f"it on its task's rows only); select those rows with dpo.categories=[{', '.join(cats)}], "
                       f"or filter and pair on the total reward")


def select_rows(tables: list[PinnedTable], f) -> pa.Table:
    """The scored rows matching the filters `f` (a DPOConfig), with a `source` column (uri@version)."""
    parts = []
    for t in tables:
        ds = lance.dataset(t.uri, version=t.version)
        extra = [c for c in OPTIONAL_SELECT if c in ds.schema.names]
        rows = ds.to_table(columns=SELECT_COLUMNS + extra, filter=_where(t, f))
        keep = np.ones(rows.num_rows, dtype=bool)
        rewards = rows["reward"].to_numpy(zero_copy_only=False)
        comps = rows["rewards"].to_pylist()
        for bounds, ok in ((f.reward_min, np.greater_equal), (f.reward_max, np.less_equal)):
            for name, bound in bounds.items():
                vals = rewards if name == "reward" else component_values(comps, name, rows["prompt_meta"].to_pylist())
                keep &= ok(vals, bound)
        if f.categories is not None:
            cats = np.array([json.loads(m).get("category") for m in rows["prompt_meta"].to_pylist()])
            keep &= np.isin(cats, list(f.categories))
        rows = rows.filter(pa.array(keep))
        parts.append(rows.append_column("source", pa.array([t.ref] * rows.num_rows, pa.string())))
    out = pa.concat_tables(parts, promote_options="default") if parts else pa.table({})
    return out.sort_by([("source", "ascending"), ("run_id", "ascending"), ("sample_id", "ascending")])
