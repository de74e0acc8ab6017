"""Decode's and score's inputs read, and decode's columns written, where the compute runs.

A distributed engine's decode and score should not route an iteration's latents and images
through the driver: at 512² a 128-row SD3 iteration is ~34 MB of fp32 latents in and ~50 MB of
PNG out, and score read the PNGs back only to ship them as decoded arrays (~100 MB) to the
reward workers.

- `RowsRead`: a worker reads rows of one table version itself — the iteration's rows of one
  fragment (decode) or a list of sample ids (score).
- decode: each rollout worker is given whole fragments of the iteration (generate's workers
  wrote one each), decodes their rows and writes the image columns as an uncommitted data file
  of that fragment (`LanceFragment.update_columns`; two writers cannot add the same columns to
  one fragment, so a fragment is the unit); the stage commits every worker's files as one
  `Update` — one new version, what the driver-side `TrajectoryStore.merge` makes.
- score: each reward worker reads its shard's images, prompts and metadata and returns the
  rewards (a few floats per row); the stage merges them as before.

Nothing a worker writes is visible before the stage's commit; files of a stage that fails are
listed by no version and go with cleanup.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import lance
import numpy as np
import pyarrow as pa

from .media import decode_media, media_bytes, png_bytes


@dataclass(frozen=True)
class RowsRead:
    """Rows of one table version that a worker reads itself: those of `scope` (one run's
    iteration, maybe one round) in `fragment_id`, or with `sample_ids` just those."""

    uri: str
    version: int
    scope: str
    fragment_id: int | None = None
    rows: int = 0  # rows of the scope the fragment holds (checked against what the worker wrote)
    sample_ids: tuple[str, ...] | None = None

    def dataset(self) -> lance.LanceDataset:
        return lance.dataset(self.uri, version=self.version)

    def read(self, columns: list[str]) -> pa.Table:
        """The rows (`_rowid` first for a fragment; by sample_id for a list of ids)."""
        ds = self.dataset()
        if self.fragment_id is not None:
            t = ds.get_fragment(self.fragment_id).to_table(columns=columns, filter=self.scope, with_row_id=True)
            if t.num_rows != self.rows:
                raise RuntimeError(f"fragment {self.fragment_id} of {self.uri}@{self.version} holds {t.num_rows} "
                                   f"rows of {self.scope!r}, the stage expected {self.rows}")
            return t
        ids = ", ".join("'" + s.replace("'", "''") + "'" for s in self.sample_ids or ())
        cols = columns if "sample_id" in columns else ["sample_id", *columns]
        t = ds.to_table(columns=cols, filter=f"({self.scope}) AND sample_id IN ({ids})").sort_by("sample_id")
        if t.num_rows != len(self.sample_ids or ()):
            got = set(t["sample_id"].to_pylist())
            raise RuntimeError(f"{self.uri}@{self.version} lacks samples "
                               f"{[s for s in self.sample_ids or () if s not in got][:3]} of {self.scope!r}")
        return t.select(columns)

    def write_columns(self, rows: pa.Table) -> "ColumnFile":
        """`rows` (`_rowid` + columns of the table) as an uncommitted data file of the fragment."""
        ds = self.dataset()
        cols = [c for c in rows.column_names if c != "_rowid"]
        values = rows.select(cols).cast(pa.schema([ds.schema.field(c) for c in cols]))
        meta, fields = ds.get_fragment(self.fragment_id).update_columns(
            values.append_column("_rowid", rows["_rowid"]), left_on="_rowid")
        return ColumnFile(self.fragment_id, meta, tuple(sorted(fields)), rows.num_rows)


@dataclass(frozen=True)
class ColumnFile:
    """What a worker wrote for one fragment: the fragment's new metadata (picklable)."""

    fragment_id: int
    metadata: object
    fields: tuple[int, ...]
    rows: int


def discard_column_files(reads: list[RowsRead], files: list[ColumnFile]) -> int:
    """Delete the data files that `files` added to their fragments (those the fragment's metadata
    lists but its version read did not): a decode whose commit will not happen. The fragment's own
    files stay. The number deleted."""
    from pyarrow import fs

    removed = 0
    for read in reads:
        written = [f for f in files if f.fragment_id == read.fragment_id]
        if not written:
            continue
        had = {d.path for d in read.dataset().get_fragment(read.fragment_id).metadata.files}
        filesystem, root = fs.FileSystem.from_uri(read.uri)
        for data in (d for f in written for d in f.metadata.files if d.path not in had):
            path = f"{root}/data/{data.path}"
            if filesystem.get_file_info(path).type == fs.FileType.File:
                filesystem.delete_file(path)
                removed += 1
    return removed


# --- what decode writes and score reads: one definition for the stage and the workers ---------
SCORE_INPUTS = ["sample_id", "prompt", "prompt_meta", "image"]
# rewards receive these in the metadata: an editing rollout's source, a sounding clip's soundtrack
SCORE_OPTIONAL = ["source_image", "soundtrack"]


def score_columns(schema_names) -> list[str]:
    """What score reads from a table with these columns: SCORE_INPUTS and the optional ones it has."""
    return SCORE_INPUTS + [c for c in SCORE_OPTIONAL if c in schema_names]


def image_columns(images: np.ndarray, soundtracks: list[bytes] | None = None) -> dict[str, pa.Array]:
    """decode's columns for images [B, H, W, 3] (PNG) or clips [B, F, H, W, 3] (encoded clip +
    PNG poster frame), with the clips' soundtracks (WAV) where the family makes sound."""
    cols = {"image": pa.array([media_bytes(im) for im in images], pa.binary())}
    if images.ndim == 5:
        cols["poster"] = pa.array([png_bytes(clip[0]) for clip in images], pa.binary())
    if soundtracks is not None:
        cols["soundtrack"] = pa.array(soundtracks, pa.binary())
    return cols


def decoded_columns(engine, decode_input: np.ndarray, prompts: list[str]) -> dict[str, pa.Array]:
    """decode's columns for these rows' decode input, computed by `engine` (its `decode`, and its
    `soundtracks` for a family whose clips have sound)."""
    return image_columns(engine.decode(decode_input, prompts), engine.soundtracks(decode_input))


def score_inputs(t: pa.Table, iteration: int) -> tuple[np.ndarray, list[str], list[dict], list[str]]:
    """(images, prompts, prompt metadata, sample ids) of rows holding SCORE_INPUTS; refuses rows
    that decode has not filled."""
    blobs = check_decoded(t, iteration)
    return np.stack([decode_media(b) for b in blobs]), t["prompt"].to_pylist(), score_metadata(t), t["sample_id"].to_pylist()


def score_metadata(t: pa.Table) -> list[dict]:
    """Each row's prompt metadata as rewards receive it: the stored JSON, plus an editing
    prompt's source image bytes under "source_image" and a sounding clip's soundtrack (WAV bytes)
    under "soundtrack" when the rows hold them."""
    metas = [json.loads(m) for m in t["prompt_meta"].to_pylist()]
    for column in SCORE_OPTIONAL:
        if column in t.column_names:
            for meta, value in zip(metas, t[column].to_pylist()):
                if value is not None:
                    meta[column] = value
    return metas


def check_decoded(t: pa.Table, iteration: int) -> list[bytes]:
    """The rows' image bytes; refuses rows that decode has not filled, naming them."""
    blobs = t["image"].to_pylist()
    missing = [sid for sid, im in zip(t["sample_id"].to_pylist(), blobs) if im is None]
    if missing:
        raise RuntimeError(f"samples {missing[:3]} have no decoded image; run decode for iteration {iteration} first")
    return blobs
