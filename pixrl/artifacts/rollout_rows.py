"""Generate's rows, and writing them from several workers as one commit.

`rows_table` turns a rollout batch plus the stage's per-row columns (keys, prompts, seeds, policy
version, recipe) into the table's Arrow rows; the stage layer and every rollout worker use it, so
rows are the same whichever process builds them.

A distributed generate (an engine with `rollout_to_store`): the stage hands the workers a
`RowSink` — the table's URI and the per-row columns — and each worker writes the rows it
generated as Lance fragments (data files that no version lists yet, invisible to readers), so the
latents never pass through the driver. The stage then commits every worker's fragments in one
Append (Overwrite when the table is new): one new table version, as a local generate's append.
Fragments that are never committed — a generate that fails before its commit, a rollout begun
ahead that no stage took — are never listed by a version; `discard_fragments` deletes their files
then (Lance's own cleanup would leave them for 7 days).
"""

from __future__ import annotations

from dataclasses import dataclass

import lance
import pyarrow as pa

from .batch import COT_FIELDS, RolloutBatch


def decoded_fields(info: dict) -> tuple[str, ...]:
    """The optional columns decode fills for an engine that `describe`s itself so: a clip's
    poster frame, a sounding clip's soundtrack."""
    return ("poster",) * bool(info.get("video")) + ("soundtrack",) * bool(info.get("audio"))


def rows_table(batch: RolloutBatch, columns: dict[str, list], decoded: tuple[str, ...], step: str) -> pa.Table:
    """The rows of `batch` with the stage's per-row `columns`, as the table stores them, with
    (null) room for the `decoded` optional columns (`decoded_fields`)."""
    batch = batch.with_columns(**columns)
    optional = tuple(decoded) + (COT_FIELDS if "cot_tokens" in batch else ())
    optional += tuple(f for f in ("means", "guidance_memory", "noise_seed", "cot_behavior_log_probs", "source_image")
                      if f in batch)
    return batch.to_arrow(batch.dims(), optional=optional, step=step)


@dataclass(frozen=True)
class RowSink:
    """Where a worker writes its share of generate's rows, and the stage's columns for them."""

    uri: str
    columns: dict[str, list]  # every row of the call, in order
    decoded: tuple[str, ...]  # the optional columns decode fills (`decoded_fields`)
    step: str
    create: bool  # the table does not exist yet: the commit creates it

    def rows(self, batch: RolloutBatch, lo: int, hi: int) -> pa.Table:
        """Rows [lo, hi) of the call, `batch` holding just those."""
        return rows_table(batch, {k: v[lo:hi] for k, v in self.columns.items()}, self.decoded, self.step)

    def write(self, table: pa.Table) -> list:
        """Uncommitted fragments holding `table` (FragmentMetadata, picklable)."""
        return lance.fragment.write_fragments(table, self.uri, schema=table.schema,
                                              mode="create" if self.create else "append")


def discard_fragments(uri: str, fragments: list) -> int:
    """Delete the data files of `fragments`, which no version lists; the number deleted."""
    from pyarrow import fs

    filesystem, root = fs.FileSystem.from_uri(uri)
    removed = 0
    for fragment in fragments:
        for data in fragment.files:
            path = f"{root}/data/{data.path}"
            if filesystem.get_file_info(path).type == fs.FileType.File:
                filesystem.delete_file(path)
                removed += 1
    return removed


def commit_fragments(uri: str, fragments: list, schema: pa.Schema, create: bool) -> int:
    """One commit listing every worker's fragments; the new version."""
    if create:
        op = lance.LanceOperation.Overwrite(schema, fragments)
        return lance.LanceDataset.commit(uri, op).version
    ds = lance.dataset(uri)
    return lance.LanceDataset.commit(ds, lance.LanceOperation.Append(fragments), read_version=ds.version).version
