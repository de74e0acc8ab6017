"""The typed rollout batch: one field spec gives the Lance schema, Arrow conversion both ways,
concatenation and slicing; optional fields appear only when asked for; algorithms' needs are
checked against a table's schema."""

import lance
import numpy as np
import pyarrow as pa
import pytest

from pixrl.algorithms.base import build_algorithm
from pixrl.artifacts.batch import TRAJECTORY_FIELDS, BatchError, RolloutBatch, missing_fields, schema
from pixrl.artifacts.trajectories import trajectory_schema
from pixrl.config.schema import AlgorithmConfig

DIMS = {"S": 2, "T": 4, "T1": 5, "latent": (4, 3, 3)}


def _batch(n: int, seed: int = 0) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return RolloutBatch({
        "run_id": ["r"] * n, "iteration": [0] * n, "sample_id": [f"s{i:02d}" for i in range(n)],
        "prompt_id": [f"p{i}" for i in range(n)], "prompt": [f"prompt {i % 2}" for i in range(n)],
        "prompt_meta": ["{}"] * n, "group_id": list(range(n)), "sample_index": [0] * n, "seed": list(range(n)),
        "policy_version": [0] * n, "family": ["sd3"] * n, "regime": ["full_sequence"] * n,
        "step_kind": ["denoise"] * n, "recipe": ["{}"] * n,
        "timesteps": f32(n, 4), "sigmas": f32(n, 5), "stored_steps": np.tile(np.array([1, 2], np.int32), (n, 1)),
        "latents": f32(n, 2, 4, 3, 3), "next_latents": f32(n, 2, 4, 3, 3), "log_probs": f32(n, 2),
        "final_latent": f32(n, 4, 3, 3),
    })


FIRST_WAVE = [  # the layout every existing table (and fork, and DPO source) was written with
    ("run_id", pa.string()), ("iteration", pa.int32()), ("sample_id", pa.string()), ("prompt_id", pa.string()),
    ("prompt", pa.string()), ("prompt_meta", pa.string()), ("group_id", pa.int32()), ("sample_index", pa.int32()),
    ("seed", pa.int64()), ("policy_version", pa.int32()), ("family", pa.string()), ("regime", pa.string()),
    ("step_kind", pa.string()), ("recipe", pa.string()), ("timesteps", pa.list_(pa.float32(), 4)),
    ("sigmas", pa.list_(pa.float32(), 5)), ("stored_steps", pa.list_(pa.int32(), 2)),
    ("latents", pa.fixed_shape_tensor(pa.float32(), [2, 4, 3, 3])),
    ("next_latents", pa.fixed_shape_tensor(pa.float32(), [2, 4, 3, 3])), ("log_probs", pa.list_(pa.float32(), 2)),
    ("final_latent", pa.fixed_shape_tensor(pa.float32(), [4, 3, 3])), ("image", pa.binary()),
    ("rewards", pa.list_(pa.struct([pa.field("name", pa.string()), pa.field("value", pa.float32())]))),
    ("reward", pa.float32()), ("advantage", pa.float32())]


def test_spec_reproduces_the_first_wave_table_layout():
    """Without optional fields the schema is exactly the one existing tables (and forks, DPO
    sources) were written with; the store's trajectory_schema is the same spec."""
    got = schema(DIMS)
    assert [(f.name, f.type) for f in got] == FIRST_WAVE
    assert [f.name for f in got if not f.nullable] == ["run_id", "iteration", "sample_id"]
    assert trajectory_schema(2, (4, 3, 3), 4) == got
    with_opt = schema(DIMS, optional=["means"])
    assert "tokens" not in with_opt.names
    assert with_opt.field("means").type == pa.fixed_shape_tensor(pa.float32(), [2, 4, 3, 3])
    roles = {f.name: f.role for f in TRAJECTORY_FIELDS}
    assert roles["next_latents"] == "action" and roles["log_probs"] == "old_log_prob" and roles["advantage"] == "advantage"
    with pytest.raises(BatchError, match="optional fields are"):
        schema(DIMS, optional=["logits"])


def test_token_rollouts_store_tokens_and_log_probs_instead_of_transitions():
    """A token family's table: the sampled tokens and their log-probs (S = image tokens), none of
    the denoise fields; the dimensions come off the batch's own shapes."""
    got = schema({"S": 16}, step="token")
    assert got.field("tokens").type == pa.list_(pa.int32(), 16) and got.field("log_probs").type == pa.list_(pa.float32(), 16)
    assert not {"latents", "next_latents", "final_latent", "timesteps", "sigmas", "stored_steps"} & set(got.names)
    assert _batch(3).dims() == DIMS
    tok = RolloutBatch({"tokens": np.zeros((2, 16), np.int32), "log_probs": np.zeros((2, 16), np.float32)})
    assert tok.dims() == {"S": 16}
    with pytest.raises(BatchError, match="step kinds"):
        schema(DIMS, step="chunk")


def test_arrow_round_trip_is_exact_and_later_stage_fields_start_null(tmp_path):
    b = _batch(6)
    t = b.to_arrow(DIMS)
    assert t["image"].null_count == 6 and t["advantage"].null_count == 6
    uri = str(tmp_path / "t.lance")
    lance.write_dataset(t, uri)
    back = RolloutBatch.from_arrow(lance.dataset(uri).to_table(columns=["sample_id", "latents", "log_probs",
                                                                        "stored_steps", "prompt"]))
    assert np.array_equal(back["latents"], b["latents"]) and back["latents"].dtype == np.float32
    assert np.array_equal(back["log_probs"], b["log_probs"])
    assert back["stored_steps"].tolist() == [[1, 2]] * 6 and back["prompt"] == b["prompt"]


def test_select_and_concat_keep_rows_together():
    b = _batch(6)
    part = b.select([4, 1])
    assert part["sample_id"] == ["s04", "s01"]
    assert np.array_equal(part["latents"][0], b["latents"][4])
    both = RolloutBatch.concat([b.select([0, 1]), b.select([2])])
    assert len(both) == 3 and np.array_equal(both["final_latent"], b["final_latent"][:3])


def test_malformed_batches_are_refused_naming_the_field():
    with pytest.raises(BatchError, match="different lengths"):
        RolloutBatch({"prompt": ["a", "b"], "seed": [1]})
    with pytest.raises(BatchError, match="unknown trajectory field"):
        RolloutBatch({"pixels": [1]})
    b = _batch(2)
    partial = RolloutBatch({k: v for k, v in b.columns.items() if k != "log_probs"})
    with pytest.raises(BatchError, match="log_probs"):
        partial.to_arrow(DIMS)


def test_an_algorithms_needs_are_checked_against_a_table():
    algo = build_algorithm(AlgorithmConfig())
    full = schema(DIMS)
    assert missing_fields(full, algo.needs) == []
    lean = pa.schema([f for f in full if f.name != "next_latents"])
    assert missing_fields(lean, algo.needs) == ["next_latents"]
