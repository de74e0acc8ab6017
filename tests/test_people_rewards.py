"""The face and pose rewards on a real photograph (matplotlib's bundled portrait of Grace Hopper),
with mediapipe's shipped models in the environment `pixrl setup-mediapipe` makes (made here once
if it is not there yet): one face found on the portrait, two on two copies side by side, none on a
blank image; the count compared with what the prompt asks for; the pose model sees the upper body
only; a killed worker fails the score naming it and the next score starts a new one; a wrong
interpreter is named with the fix."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import matplotlib
import numpy as np
import pytest
from PIL import Image

from pixrl.rewards.base import ScoringError, build_reward
from pixrl.rewards.compose import RewardSet
from pixrl.rewards.mediapipe_client import MediapipeWorker
from pixrl.rewards.people import expected_people

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def mp_python():
    if os.environ.get("PIXRL_MEDIAPIPE_PYTHON"):
        return os.environ["PIXRL_MEDIAPIPE_PYTHON"]
    py = ROOT / ".venv-mediapipe" / "bin" / "python"
    if not py.is_file():  # the real install, as a user makes it (about 10 s from the registry)
        subprocess.run([sys.executable, "-m", "pixrl.cli", "setup-mediapipe", "--venv", str(py.parents[1])],
                       check=True, cwd=ROOT, capture_output=True)
    return str(py)


@pytest.fixture(scope="module")
def photos():
    path = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    portrait = np.asarray(Image.open(path).convert("RGB").resize((256, 300)))
    pair = np.asarray(Image.fromarray(np.concatenate([portrait, portrait], 1)).resize((384, 384)))
    return (np.stack([np.asarray(Image.fromarray(portrait).resize((384, 384))), pair,
                      np.zeros((384, 384, 3), np.uint8)]))


def _rs(mp_python, **options):
    return RewardSet({"face": 1.0, "pose": 1.0},
                     {"face": {"python": mp_python, **options}, "pose": {"python": mp_python}})


def test_faces_are_counted_and_compared_with_the_prompt(mp_python, photos):
    rs = _rs(mp_python)
    out = rs.score(photos, ["a portrait of a woman", "two women side by side", "an empty room"], [{}] * 3, list("abc"))
    assert out["face.count"].tolist() == [1, 2, 0]
    assert (out["face.max_score"][:2] > 0.8).all() and out["face.max_score"][2] == 0
    assert out["face"].tolist() == [1.0, 1.0, 0.0]  # asked for 1, 2, and (no count asked) nothing is there
    wrong = rs.score(photos, ["two women side by side", "a woman", "a room"], [{}, {}, {"faces": 0}], list("abc"))
    assert wrong["face"].tolist() == [0.5, 0.0, 1.0]  # 1 of 2; 2 for 1; none asked, none found


def test_the_face_box_is_on_the_face(mp_python, photos):
    (faces,) = MediapipeWorker.of(mp_python).call("face", photos[:1], min_confidence=0.5, model_selection=0)
    (score, x, y, w, h), = faces
    assert 0.25 < x + w / 2 < 0.75 and 0.2 < y + h / 2 < 0.6 and 0.1 < w < 0.7  # the head, upper middle


def test_pose_sees_the_upper_body_only(mp_python, photos):
    out = _rs(mp_python).score(photos, ["a", "b", "c"], [{}] * 3, list("abc"))
    assert out["pose.detected"].tolist() == [1.0, 1.0, 0.0]
    assert 0.2 < out["pose"][0] < 0.8 and out["pose"][2] == 0.0  # a portrait: no hips, knees or feet


def test_scores_repeat_and_do_not_depend_on_the_batch(mp_python, photos):
    prompts = ["a woman", "two women", "a room"]
    one = RewardSet({"face": 1.0}, {"face": {"python": mp_python, "batch": 1}}).score(photos, prompts, [{}] * 3,
                                                                                     list("abc"))
    all_ = RewardSet({"face": 1.0}, {"face": {"python": mp_python}}).score(photos, prompts, [{}] * 3, list("abc"))
    assert all(np.array_equal(one[k], all_[k]) for k in one)


def test_a_killed_worker_is_named_and_replaced(mp_python, photos):
    rs = RewardSet({"face": 1.0}, {"face": {"python": mp_python}})
    rs.score(photos[:1], ["a woman"], [{}], ["a"])
    worker = MediapipeWorker.of(mp_python)
    os.kill(worker.proc.pid, signal.SIGKILL)
    worker.proc.wait()
    with pytest.raises(ScoringError, match="mediapipe worker .* exited with code -9"):
        rs.score(photos[:1], ["a woman"], [{}], ["a"])
    assert rs.score(photos[:1], ["a woman"], [{}], ["a"])["face"].tolist() == [1.0]


def test_a_wrong_interpreter_is_named_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="pixrl setup-mediapipe"):
        build_reward("face", python=str(tmp_path / "nothing" / "python"))
    r = build_reward("pose", python=sys.executable)  # pixrl's own environment has no mediapipe
    with pytest.raises(ScoringError, match="cannot run mediapipe .*pixrl setup-mediapipe"):
        r.ensure_setup("cpu")


@pytest.mark.parametrize("prompt,n", [("a man and a woman", 2), ("two women side by side", 2),
                                      ("a photo of two women", 2), ("3 kids playing", 3), ("a couple of people", 2),
                                      ("a woman with two dogs", 1), ("a group of people", None),
                                      ("a red circle", None), ("no people, an empty street", 0)])
def test_the_number_of_people_a_prompt_asks_for(prompt, n):
    assert expected_people(prompt, {}) == n
    assert expected_people(prompt, {"people": 4}) == 4
