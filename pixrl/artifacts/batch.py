"""The typed rollout batch: one field specification (name, axes, role, dtype) that produces the
Lance schema, Arrow conversion in both directions, concatenation and slicing.

A field with one axis is stored as a fixed-size list, with more as a fixed_shape_tensor (both
readable by plain pyarrow/duckdb); axes are named so that the shapes come from the run's
dimensions: S stored steps (a token rollout: its image tokens), T sampler steps, T1 = T + 1
sigmas, and `*latent` for the family's latent shape ([C, H, W] for images, [C, F, H, W] for
video). Roles follow visual-rl: key, meta, observation, action, old_log_prob, mean, reward,
advantage. `filled_by` says which stage writes the field (generate writes all others; the rest
start as nulls).

A field's `step` says which rollouts store it: denoise families the transitions and final
latents, token families the sampled `tokens`; both the per-step `log_probs` (S = stored steps, or
image tokens). Optional fields (`means`, `guidance_memory`, `poster`, `soundtrack`, `source_image`) are only in a table
whose run needs them. A
denoise run that needs none gets exactly the first wave's table layout, so older tables, forks
and DPO sources stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import pyarrow as pa

from ..errors import ExpectedError

REWARD_ITEM = pa.struct([pa.field("name", pa.string()), pa.field("value", pa.float32())])


@dataclass(frozen=True)
class FieldSpec:
    name: str
    dtype: pa.DataType
    axes: tuple[str, ...] = ()
    role: str = "meta"
    filled_by: str = "generate"
    optional: bool = False
    nullable: bool = True
    step: str | None = None  # "denoise" / "token": only rollouts of that step kind store it

    def arrow_type(self, dims: dict[str, Any]) -> pa.DataType:
        if not self.axes:
            return self.dtype
        shape = [d for a in self.axes for d in (dims[a[1:]] if a.startswith("*") else (dims[a],))]
        if len(shape) == 1:
            return pa.list_(self.dtype, shape[0])
        return pa.fixed_shape_tensor(self.dtype, shape)


F = FieldSpec
TRAJECTORY_FIELDS: tuple[FieldSpec, ...] = (
    F("run_id", pa.string(), role="key", nullable=False),
    F("iteration", pa.int32(), role="key", nullable=False),
    F("sample_id", pa.string(), role="key", nullable=False),
    F("prompt_id", pa.string()),
    F("prompt", pa.string(), role="observation"),
    F("prompt_meta", pa.string()),  # JSON
    # an editing prompt's source image (encoded bytes, as the dataset gave them): what the
    # conditioning is encoded from at rollout and replay (models/source_images.py)
    F("source_image", pa.binary(), role="observation", optional=True),
    F("group_id", pa.int32()),
    F("sample_index", pa.int32()),
    F("seed", pa.int64()),
    F("policy_version", pa.int32()),
    F("family", pa.string()),
    F("regime", pa.string()),
    F("step_kind", pa.string()),
    F("recipe", pa.string()),  # JSON: sampler, steps, noise level, window, cfg, dtype, engine
    F("timesteps", pa.float32(), ("T",), step="denoise"),
    F("sigmas", pa.float32(), ("T1",), step="denoise"),
    F("stored_steps", pa.int32(), ("S",), step="denoise"),
    F("latents", pa.float32(), ("S", "*latent"), role="observation", step="denoise"),
    F("next_latents", pa.float32(), ("S", "*latent"), role="action", step="denoise"),
    F("log_probs", pa.float32(), ("S",), role="old_log_prob"),
    F("means", pa.float32(), ("S", "*latent"), role="mean", optional=True, step="denoise"),
    # a stateful guider's memory before each stored step (APG's momentum buffer: algorithms/guidance_memory.py)
    F("guidance_memory", pa.float32(), ("S", "*latent"), role="observation", optional=True, step="denoise"),
    F("noise_seed", pa.int64(), optional=True, step="denoise"),  # the initial latent's seed, when a group shares one
    F("final_latent", pa.float32(), ("*latent",), role="observation", step="denoise"),
    F("tokens", pa.int32(), ("S",), role="action", step="token"),  # the sampled image tokens
    # a semantic chain of thought before the image (sampling.cot_tokens = C): its text tokens
    # (pad after the end), which of them were sampled (end-of-sentence included), their log-probs
    F("cot_tokens", pa.int32(), ("C",), role="action", optional=True, step="token"),
    F("cot_mask", pa.int8(), ("C",), role="meta", optional=True, step="token"),
    F("cot_log_probs", pa.float32(), ("C",), role="old_log_prob", optional=True, step="token"),
    # the text's log-probs under the server that sampled it (sampling.cot_backend=vllm), 0 where masked:
    # the behaviour policy beside the policy's own cot_log_probs
    F("cot_behavior_log_probs", pa.float32(), ("C",), role="meta", optional=True, step="token"),
    F("image", pa.binary(), role="observation", filled_by="decode"),  # PNG; a clip: MP4, lossless H.264 RGB
    F("poster", pa.binary(), role="observation", filled_by="decode", optional=True),  # a clip's first frame, PNG
    # a sounding clip's soundtrack (a family with `audio`: LTX-2), 16-bit PCM WAV at the vocoder's rate
    F("soundtrack", pa.binary(), role="observation", filled_by="decode", optional=True),
    F("rewards", pa.list_(REWARD_ITEM), role="reward", filled_by="score"),  # per component
    F("reward", pa.float32(), role="reward", filled_by="score"),  # weighted total
    F("advantage", pa.float32(), role="advantage", filled_by="replay"),
)
FIELDS = {f.name: f for f in TRAJECTORY_FIELDS}


class BatchError(ExpectedError, ValueError):
    """A batch or table that does not match the field specification."""


STEP_KINDS = ("denoise", "token")
#: the fields a token rollout with a chain of thought adds
COT_FIELDS = ("cot_tokens", "cot_mask", "cot_log_probs")
#: the field the decode stage turns into images, per step kind
DECODE_INPUT = {"denoise": "final_latent", "token": "tokens"}


#: a denoise rollout's stored transitions: absent from a table whose rollouts store none (S = 0,
#: DiffusionNFT's final-latent-only rollouts), since an empty fixed-shape column cannot be stored
TRANSITION_FIELDS = ("stored_steps", "latents", "next_latents", "log_probs", "means", "guidance_memory")


def fields_for(optional: Iterable[str] = (), step: str = "denoise", transitions: bool = True) -> tuple[FieldSpec, ...]:
    want = set(optional)
    unknown = want - {f.name for f in TRAJECTORY_FIELDS if f.optional}
    if unknown:
        raise BatchError(f"unknown optional trajectory field(s) {sorted(unknown)}; optional fields are "
                         f"{[f.name for f in TRAJECTORY_FIELDS if f.optional]}")
    if step not in STEP_KINDS:
        raise BatchError(f"unknown step kind {step!r}; step kinds: {', '.join(STEP_KINDS)}")
    return tuple(f for f in TRAJECTORY_FIELDS if f.step in (None, step) and (not f.optional or f.name in want)
                 and (transitions or f.name not in TRANSITION_FIELDS))


def _transitions(dims: dict[str, Any], step: str) -> bool:
    return step != "denoise" or dims.get("S", 1) > 0


def schema(dims: dict[str, Any], optional: Iterable[str] = (), step: str = "denoise") -> pa.Schema:
    return pa.schema([pa.field(f.name, f.arrow_type(dims), nullable=f.nullable)
                      for f in fields_for(optional, step, _transitions(dims, step))])


def rollout_fields(semantics) -> set[str]:
    """Every field a rollout of a family with these semantics can store (optional ones included)."""
    return {f.name for f in TRAJECTORY_FIELDS if f.step in (None, semantics.step.value)}


def missing_fields(table_schema: pa.Schema, needed: Iterable[str]) -> list[str]:
    """The needed fields a table lacks (preflight of a run or an offline source)."""
    return sorted(set(needed) - set(table_schema.names))


def _to_arrow(spec: FieldSpec, values: Any, typ: pa.DataType, n: int) -> pa.Array:
    if values is None:
        return pa.nulls(n, typ)
    if isinstance(typ, pa.FixedShapeTensorType):
        arr = np.ascontiguousarray(values, dtype=typ.value_type.to_pandas_dtype())
        return pa.FixedShapeTensorArray.from_numpy_ndarray(arr)
    if isinstance(typ, pa.FixedSizeListType):
        flat = pa.array(np.asarray(values).reshape(-1), type=typ.value_type)
        return pa.FixedSizeListArray.from_arrays(flat, typ.list_size)
    return pa.array(values, typ)


def _from_arrow(col: pa.ChunkedArray | pa.Array) -> Any:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if isinstance(col.type, pa.FixedShapeTensorType):
        return col.to_numpy_ndarray()
    if isinstance(col.type, pa.FixedSizeListType):
        return col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), col.type.list_size)
    if pa.types.is_primitive(col.type) and not col.null_count:
        return col.to_numpy(zero_copy_only=False)
    return col.to_pylist()


class RolloutBatch:
    """Columns by field name (numpy arrays with the row axis first, or lists), all of one length."""

    def __init__(self, columns: dict[str, Any]):
        unknown = set(columns) - set(FIELDS)
        if unknown:
            raise BatchError(f"unknown trajectory field(s) {sorted(unknown)}; the spec has {list(FIELDS)}")
        lengths = {k: len(v) for k, v in columns.items()}
        if len(set(lengths.values())) > 1:
            raise BatchError(f"columns of different lengths: {lengths}")
        self.columns = dict(columns)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def __getitem__(self, name: str) -> Any:
        try:
            return self.columns[name]
        except KeyError:
            raise BatchError(f"the batch has no {name!r} field (it has {sorted(self.columns)})") from None

    def __contains__(self, name: str) -> bool:
        return name in self.columns

    def with_columns(self, **columns: Any) -> "RolloutBatch":
        return RolloutBatch({**self.columns, **columns})

    def select(self, idx) -> "RolloutBatch":
        """Rows `idx` (a list or array of positions), in that order."""
        idx = np.asarray(idx, dtype=np.int64)
        return RolloutBatch({k: v[idx] if isinstance(v, np.ndarray) else [v[i] for i in idx]
                             for k, v in self.columns.items()})

    @staticmethod
    def concat(batches: list["RolloutBatch"]) -> "RolloutBatch":
        names = list(batches[0].columns)
        if any(list(b.columns) != names for b in batches):
            raise BatchError("concatenated batches must have the same fields")
        return RolloutBatch({k: np.concatenate([b[k] for b in batches]) if isinstance(batches[0][k], np.ndarray)
                             else [x for b in batches for x in b[k]] for k in names})

    def dims(self) -> dict[str, Any]:
        """The run's dimensions (S, T, T1, latent, …) read off the shapes of the columns present."""
        out: dict[str, Any] = {}
        for name, col in self.columns.items():
            spec = FIELDS[name]
            if not spec.axes or not isinstance(col, np.ndarray):
                continue
            shape = col.shape[1:]
            for i, axis in enumerate(spec.axes):
                if axis.startswith("*"):  # a group of axes: the rest of the shape
                    out[axis[1:]] = tuple(int(d) for d in shape[i:])
                    break
                out[axis] = int(shape[i])
        return out

    def to_arrow(self, dims: dict[str, Any], optional: Iterable[str] = (), step: str = "denoise") -> pa.Table:
        """The batch as rows of the trajectory table; fields later stages fill start as nulls, and
        a generate field that is missing is an error (a row is never stored half-built)."""
        sch = schema(dims, optional, step)
        n = len(self)
        absent = [f.name for f in fields_for(optional, step, _transitions(dims, step))
                  if f.filled_by == "generate" and f.name not in self.columns]
        if absent:
            raise BatchError(f"rollout batch lacks generate field(s) {absent}")
        arrays = [_to_arrow(FIELDS[f.name], self.columns.get(f.name), f.type, n) for f in sch]
        return pa.Table.from_arrays(arrays, schema=sch)

    @staticmethod
    def from_arrow(table: pa.Table) -> "RolloutBatch":
        return RolloutBatch({name: _from_arrow(table[name]) for name in table.column_names})
