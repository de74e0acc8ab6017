"""`audiobox_aesthetics`, the soundtrack quality reward, against Meta's own model code: the
`audiobox_aesthetics` package (0.0.4, installed for the test without its torchaudio dependency,
which cannot live beside this torch) builds a random `AesMultiOutput` — WavLM Base+ and the four
axis heads — and saves it as the released checkpoint is saved (config.json + model.safetensors);
the reward reads it into transformers' WavLM and must give what the package's model gives for the
same windows, on every axis, for clips of one and of several 10 s windows."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from pixrl.artifacts.media import read_wav, wav_bytes
from pixrl.rewards.compose import RewardSet

AXES = ["CE", "CU", "PC", "PQ"]
TRANSFORM = {a: {"mean": 5.0 + i, "std": 1.5 + 0.1 * i} for i, a in enumerate(AXES)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(the package's model, the checkpoint it saved)."""
    target = tmp_path_factory.mktemp("audiobox_pkg")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    "audiobox_aesthetics==0.0.4"], check=True)
    sys.path.insert(0, str(target))
    try:
        from audiobox_aesthetics.model.aes import AesMultiOutput
    finally:
        sys.path.remove(str(target))
    torch.manual_seed(0)
    model = AesMultiOutput(target_transform=TRANSFORM).eval()
    with torch.no_grad():  # a layer mix that is not uniform, heads that are not zero: all of them read
        for a in AXES:
            model.layer_weights[a].normal_()
    path = tmp_path_factory.mktemp("audiobox") / "checkpoint"
    model.save_pretrained(str(path))
    return model, path


@pytest.fixture(scope="module")
def rewards(reference):
    """The reward over that checkpoint (loaded once), its main value the mean of PQ and CE."""
    return RewardSet({"audiobox_aesthetics": 1.0},
                     {"audiobox_aesthetics": {"path": str(reference[1]), "axes": ["pq", "ce"]}})


def _package_scores(model, waves, rate=16_000):
    """The package's model over each clip's 10 s windows (zero-padded, masked), weighted by their
    unpadded share as its `AesPredictor.forward` weighs them; on the 1–10 scale."""
    out = {a: [] for a in AXES}
    for w in waves:
        mono = torch.tensor(read_wav(wav_bytes(w, rate))[0].astype(np.float64).mean(0), dtype=torch.float32)
        wins, masks, shares = [], [], []
        for s in range(0, len(mono), 160_000):
            part = mono[s:s + 160_000]
            wins.append(torch.nn.functional.pad(part, (0, 160_000 - len(part)))[None])
            mask = torch.zeros(1, 160_000, dtype=torch.bool)
            mask[:, :len(part)] = True
            masks.append(mask)
            shares.append(len(part) / 160_000)
        with torch.no_grad():
            pred = model({"wav": torch.stack(wins), "mask": torch.stack(masks)})
        shares = torch.tensor(shares)
        for a in AXES:
            v = pred[a] * TRANSFORM[a]["std"] + TRANSFORM[a]["mean"]
            out[a].append(float((v * shares).sum() / shares.sum()))
    return {a: np.array(v) for a, v in out.items()}


def rewards_of(path):
    return RewardSet({"audiobox_aesthetics": 1.0}, {"audiobox_aesthetics": {"path": str(path)}})


def _clips(n):
    return np.zeros((n, 2, 8, 8, 3), np.uint8)


def test_every_axis_is_the_packages_model_on_one_and_on_several_windows(reference, rewards):
    model, _ = reference
    rng = np.random.default_rng(0)
    t = np.arange(int(16_000 * 12.5)) / 16_000
    waves = [rng.uniform(-0.3, 0.3, (2, 16_000 * 2)).astype(np.float32),  # one window, mostly padding
             np.stack([0.4 * np.sin(2 * np.pi * 220 * t), 0.2 * np.sin(2 * np.pi * 330 * t)]).astype(np.float32)]
    got = rewards.score(_clips(2), ["a", "b"], [{"soundtrack": wav_bytes(w, 16_000)} for w in waves], ["x", "y"])
    want = _package_scores(model, waves)
    for a in AXES:
        assert np.abs(got[f"audiobox_aesthetics.{a.lower()}"] - want[a]).max() < 1e-4, a
    assert np.allclose(got["audiobox_aesthetics"], (want["PQ"] + want["CE"]) / 2, atol=1e-4)
    assert np.abs(want["PQ"][0] - want["PQ"][1]) > 1e-4  # the clips differ, so the match is not a constant's


def test_misuse_is_refused_naming_the_fix(reference, tmp_path):
    _, path = reference
    with pytest.raises(ValueError, match="not an Audiobox Aesthetics checkpoint.*audiobox_aesthetics.path"):
        RewardSet({"audiobox_aesthetics": 1.0}, {"audiobox_aesthetics": {"path": str(tmp_path)}})
    with pytest.raises(ValueError, match=r"axes=\['LOUDNESS'\]; choose from"):
        RewardSet({"audiobox_aesthetics": 1.0}, {"audiobox_aesthetics": {"path": str(path), "axes": ["loudness"]}})
    with pytest.raises(ValueError, match="makes no sound"):
        rewards_of(path).check_media(video=True, audio=False)
    rewards_of(path).check_scores(["audiobox_aesthetics.pq", "audiobox_aesthetics.ce"], "reward.advantage_weights")
