"""Reward contract and composition; the Lance store's write rules."""

import io

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from pixrl.artifacts.trajectories import StoreError, TrajectoryStore
from pixrl.datasets.shapes.prompts import parse
from pixrl.datasets.shapes.render import render_prompt
from pixrl.rewards.base import ScoringError, build_reward, registered_rewards
from pixrl.rewards.compose import RewardSet


def test_jpeg_compressibility_is_minus_kilobytes():
    rng = np.random.default_rng(0)
    noisy = rng.integers(0, 255, (2, 32, 32, 3), dtype=np.uint8)
    flat = np.full((1, 32, 32, 3), 128, np.uint8)
    r = build_reward("jpeg_compressibility")
    buf = io.BytesIO()
    Image.fromarray(noisy[0]).save(buf, format="JPEG", quality=95)
    out = r.score(noisy, ["", ""], [{}, {}])["jpeg_compressibility"]
    assert out[0] == pytest.approx(-buf.tell() / 1000)
    assert r.score(flat, [""], [{}])["jpeg_compressibility"][0] > out[0]


def test_shapes_reward_mixes_correct_and_partial():
    meta = parse("a red circle to the left of a blue square")
    img = render_prompt(meta, 0)
    blank = np.full_like(img, 255)
    r = RewardSet({"shapes": 1.0}, {"shapes": {"correct_weight": 0.5}})
    out = r.score(np.stack([img, blank]), ["x", "x"], [meta, meta], ["a", "b"])
    assert out["shapes.correct"].tolist() == [1.0, 0.0]
    assert out["reward"].tolist() == pytest.approx([1.0, 0.0])


def test_reward_set_validates_every_score():
    assert {"shapes", "jpeg_compressibility", "jpeg_incompressibility"} <= set(registered_rewards())
    with pytest.raises(KeyError, match="registered rewards"):
        RewardSet({"clip": 1.0})
    with pytest.raises(ValueError, match="not in reward.weights"):
        RewardSet({"shapes": 1.0}, {"jpeg_compressibility": {}})
    with pytest.raises(ScoringError, match="no shapes metadata"):
        RewardSet({"shapes": 1.0}).score(np.zeros((1, 8, 8, 3), np.uint8), ["free text"], [{}], ["s0"])


def _rows(run="r", it=0, n=3):
    return pa.table({"run_id": [run] * n, "iteration": pa.array([it] * n, pa.int32()),
                     "sample_id": [f"s{i}" for i in range(n)], "reward": pa.nulls(n, pa.float32())})


def test_store_append_merge_and_refusals(tmp_path):
    st = TrajectoryStore(str(tmp_path / "t.lance"))
    ref = st.append(_rows())
    assert ref.version == 1
    with pytest.raises(StoreError, match="refusing to overwrite"):
        st.append(_rows())
    upd = pa.table({"run_id": ["r"] * 3, "iteration": pa.array([0] * 3, pa.int32()),
                    "sample_id": ["s0", "s1", "s2"], "reward": pa.array([1.0, 2.0, 3.0], pa.float32())})
    ref2 = st.merge(upd)
    assert ref2.version == 2
    assert st.read(ref2, "r", 0, ["reward"])["reward"].to_pylist() == [1.0, 2.0, 3.0]
    assert st.read(ref, "r", 0, ["reward"])["reward"].null_count == 3  # the old version is unchanged
    with pytest.raises(StoreError, match="holds 3"):
        st.merge(upd.slice(0, 2))
    assert st.latest_version() == 2


def test_a_scoped_append_and_merge_touch_only_their_rows(tmp_path):
    """Dynamic sampling's rounds: a second round appends beside the first and fills only its own
    rows; a round already stored is refused, and a merge must cover every row of its scope."""
    def rows(lo, hi):
        n = hi - lo
        return pa.table({"run_id": ["r"] * n, "iteration": pa.array([0] * n, pa.int32()),
                         "sample_id": [f"s{i}" for i in range(lo, hi)], "group_id": pa.array(range(lo, hi), pa.int32()),
                         "reward": pa.nulls(n, pa.float32())})

    st = TrajectoryStore(str(tmp_path / "t.lance"))
    st.append(rows(0, 2), where="group_id < 2")
    st.append(rows(2, 4), where="group_id >= 2")
    with pytest.raises(StoreError, match="where group_id >= 2; refusing to overwrite"):
        st.append(rows(2, 4), where="group_id >= 2")
    upd = rows(2, 4).drop_columns(["group_id"]).set_column(3, "reward", pa.array([5.0, 6.0], pa.float32()))
    with pytest.raises(StoreError, match="holds 4"):
        st.merge(upd)  # unscoped: the iteration holds 4 rows
    ref = st.merge(upd, where="group_id >= 2")
    assert st.read(ref, "r", 0, ["reward"])["reward"].to_pylist() == [None, None, 5.0, 6.0]
    assert st.read(ref, "r", 0, ["sample_id"], where="group_id < 2")["sample_id"].to_pylist() == ["s0", "s1"]


def test_a_reward_whose_packages_are_missing_is_refused_naming_its_extra():
    from pixrl.rewards.base import Reward

    class NeedsPackage(Reward):
        name = "needs_package"
        requires = ("pixrl_no_such_module",)
        extra = "someextra"

        def setup(self, device="cpu"):
            self.optional_import("pixrl_no_such_module", "Thing")

        def score(self, images, prompts, metadata):
            return {}

    rs = RewardSet({"jpeg_compressibility": 1.0})
    rs.rewards["needs_package"] = NeedsPackage()
    with pytest.raises(ValueError, match=r"needs pixrl_no_such_module, which is not installed; .*pixrl\[someextra\]"):
        rs.check_installed()
    with pytest.raises(ScoringError, match=r"pixrl_no_such_module is missing.*pixrl\[someextra\]"):
        NeedsPackage().ensure_setup("cpu")
