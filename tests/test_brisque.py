"""BRISQUE: the 36 features against OpenCV's own (opencv_contrib's QualityBRISQUE, recorded by
benchmarks/brisque_reference.py on crops of scikit-image's photographs and distorted copies);
the SVR against libsvm's own prediction with the model shipped in the brisque wheel; the
moment-matching fit against samples drawn from a known asymmetric generalised Gaussian; and the
reward: distortions score worse than the clean photograph, scores repeat, bad settings fail
naming the setting."""

import json
from pathlib import Path

import numpy as np
import pytest
from scipy.special import gamma as G

from pixrl.rewards.base import ScoringError, build_reward
from pixrl.rewards.brisque import SVR, aggd_fit, features, wheel_model
from pixrl.rewards.compose import RewardSet

DATA = Path(__file__).parent / "data"
REF = json.loads((DATA / "brisque_opencv.json").read_text())["images"]
IMAGES = np.load(DATA / "brisque_images.npz")


@pytest.mark.parametrize("name", sorted(REF))
def test_features_equal_opencvs(name):
    got, ref = features(IMAGES[name]), np.array(REF[name]["features"])
    assert got.shape == (36,) and got.dtype == np.float32
    shapes = np.r_[0, [2 + 4 * k for k in range(4)]]  # each fit's γ: grid points, so exactly equal
    shapes = np.r_[shapes, shapes + 18]
    assert np.allclose(got[shapes], ref[shapes], rtol=0, atol=1e-6), (got[shapes], ref[shapes])
    # the rest within OpenCV's float32 sums (its cv::sum accumulates float32 blocks; the fit here sums in float64)
    assert np.allclose(got, ref, rtol=3e-3, atol=2e-5), np.abs(got - ref).max()


def test_the_svr_is_libsvms_prediction():
    from libsvm import svmutil

    model_path, scale_path = wheel_model()
    svr = SVR.libsvm(model_path, scale_path)
    model = svmutil.svm_load_model(str(model_path))
    for name in sorted(REF):
        f = features(IMAGES[name])
        x = -1 + 2 * (f.astype(np.float64) - svr.lo) / (svr.hi - svr.lo)
        ref = svmutil.svm_predict([0.0], [list(x)], model, "-q")[0][0]
        assert svr(f) == pytest.approx(ref, abs=1e-6)


def test_an_opencv_model_file_reads_as_the_same_svr(tmp_path):
    import cv2

    svr = SVR.libsvm(*wheel_model())
    fs = cv2.FileStorage(str(tmp_path / "model.yml"), cv2.FILE_STORAGE_WRITE)  # OpenCV's ml::SVM layout
    fs.startWriteStruct("opencv_ml_svm", cv2.FILE_NODE_MAP)
    fs.write("svmType", "EPS_SVR")
    fs.startWriteStruct("kernel", cv2.FILE_NODE_MAP)
    fs.write("type", "RBF")
    fs.write("gamma", svr.gamma)
    fs.endWriteStruct()
    fs.startWriteStruct("support_vectors", cv2.FILE_NODE_SEQ)
    for row in svr.sv:
        fs.startWriteStruct("", cv2.FILE_NODE_SEQ | cv2.FILE_NODE_FLOW)
        for v in row:
            fs.write("", float(v))
        fs.endWriteStruct()
    fs.endWriteStruct()
    fs.startWriteStruct("decision_functions", cv2.FILE_NODE_SEQ)
    fs.startWriteStruct("", cv2.FILE_NODE_MAP)
    fs.write("sv_count", len(svr.sv))
    fs.write("rho", svr.rho)
    fs.startWriteStruct("alpha", cv2.FILE_NODE_SEQ | cv2.FILE_NODE_FLOW)
    for a in svr.alpha:
        fs.write("", float(a))
    fs.endWriteStruct()
    fs.endWriteStruct()
    fs.endWriteStruct()
    fs.endWriteStruct()
    fs.release()
    fr = cv2.FileStorage(str(tmp_path / "range.yml"), cv2.FILE_STORAGE_WRITE)
    fr.write("range", np.stack([svr.lo, svr.hi]).astype(np.float32))
    fr.release()
    other = SVR.opencv(tmp_path / "model.yml", tmp_path / "range.yml")
    f = features(IMAGES["chelsea_blur2"])
    assert other.sv.shape == svr.sv.shape and other(f) == pytest.approx(svr(f), abs=1e-3)  # range stored as float32


@pytest.mark.parametrize("shape,left,right", [(0.8, 1.0, 2.0), (2.0, 0.5, 0.5), (1.3, 1.5, 0.7)])
def test_the_fit_recovers_a_known_asymmetric_generalised_gaussian(shape, left, right):
    """|x|^γ / β^γ ~ Gamma(1/γ) on each side, β = σ·√(Γ(1/γ)/Γ(3/γ)), side chosen ∝ β."""
    rng = np.random.default_rng(0)
    beta = lambda s: s * np.sqrt(G(1 / shape) / G(3 / shape))  # noqa: E731
    n = 400_000
    neg = rng.random(n) < beta(left) / (beta(left) + beta(right))
    mag = rng.gamma(1 / shape, 1.0, n) ** (1 / shape)
    x = np.where(neg, -beta(left) * mag, beta(right) * mag).astype(np.float32)
    g, l, r = aggd_fit(x)
    assert g == pytest.approx(shape, rel=0.03)
    assert l == pytest.approx(left, rel=0.01) and r == pytest.approx(right, rel=0.01)


def test_distortions_score_worse_and_scores_repeat():
    rs = RewardSet({"brisque": 1.0}, {"brisque": {}})
    names = ["chelsea", "chelsea_blur2", "chelsea_noise20", "chelsea_jpeg10"]
    imgs = np.stack([IMAGES[n] for n in names])
    out = rs.score(imgs, [""] * 4, [{}] * 4, names)
    reward, raw = out["brisque"], out["brisque.raw"]
    assert ((reward >= 0) & (reward <= 1)).all() and np.isfinite(raw).all()
    assert np.allclose(reward, 1 - np.clip(raw, 0, 100) / 100)
    assert raw[0] < 10 and (raw[1:] > raw[0] + 20).all(), raw  # the clean photograph is the best
    again = rs.score(imgs[::-1].copy(), [""] * 4, [{}] * 4, names[::-1])["brisque.raw"]
    assert np.array_equal(again[::-1], raw)


def test_bad_settings_and_flat_images_are_named(tmp_path):
    with pytest.raises(ValueError, match="reward.options.brisque.model"):
        build_reward("brisque", model=str(tmp_path / "missing.yml"))
    (tmp_path / "m.yml").write_text("%YAML:1.0\n")
    with pytest.raises(ValueError, match="reward.options.brisque.range"):
        build_reward("brisque", model=str(tmp_path / "m.yml"))
    (tmp_path / "r.yml").write_text("%YAML:1.0\n")
    r = build_reward("brisque", model=str(tmp_path / "m.yml"), range=str(tmp_path / "r.yml"))
    with pytest.raises(ScoringError, match="could not read the model"):
        r.ensure_setup("cpu")
    rs = RewardSet({"brisque": 1.0}, {"brisque": {}})
    with pytest.raises(ScoringError, match="natural image"):
        rs.score(np.full((1, 64, 64, 3), 128, np.uint8), [""], [{}], ["flat"])
