"""`clap_score`, the soundtrack reward, on tiny random CLAP checkpoints written in the released
layout (`write_tiny_clap`: ClapModel + ClapProcessor, unfused and fused): the score is the
cosine ClapModel's own forward gives for the soundtrack and its text, whatever the batch and the
call; the soundtrack goes in mono at the extractor's rate; `text_key` reads the metadata; and
every misuse — no checkpoint, no feature extractor, a missing text, a silent family, a sample
without its soundtrack — is refused naming the fix."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from pixrl.artifacts.media import clip_bytes, read_wav, wav_bytes
from pixrl.cli import app
from pixrl.rewards.base import ScoringError
from pixrl.rewards.clap import to_mono_at
from pixrl.rewards.clap_tiny import write_tiny_clap
from pixrl.rewards.compose import RewardSet

PROMPTS = ["a red circle", "two blue squares", "a dog and a bird", "rain on a roof", "a bell"]


@pytest.fixture(scope="module", params=[False, True], ids=["unfused", "fused"])
def tiny_clap(request, tmp_path_factory):
    return write_tiny_clap(tmp_path_factory.mktemp("clap") / "clap", seed=0, fusion=request.param)


def _sounds(rate=48_000, seed=0):
    """Five stereo soundtracks of different lengths (one longer than the tiny extractor's 2 s)."""
    rng = np.random.default_rng(seed)
    t = [np.arange(int(rate * s)) / rate for s in (0.5, 1.0, 1.5, 0.25, 2.5)]
    return [np.stack([0.3 * np.sin(2 * np.pi * (200 + 150 * i) * x), rng.uniform(-0.2, 0.2, x.size)]).astype(np.float32)
            for i, x in enumerate(t)]


def _metas(waves, rate=48_000):
    return [{"soundtrack": wav_bytes(w, rate)} for w in waves]


def _clips(n):
    return np.zeros((n, 2, 8, 8, 3), np.uint8)


def test_the_score_is_clap_models_own_cosine_in_any_batch(tiny_clap):
    from transformers import ClapModel, ClapProcessor

    rs = RewardSet({"clap_score": 1.0}, {"clap_score": {"path": str(tiny_clap), "batch_size": 2}})
    metas = _metas(_sounds()[:4])  # within the window: the model's own forward needs no crop
    got = rs.score(_clips(4), PROMPTS[:4], metas, list("abcd"))["clap_score"]
    assert got.shape == (4,) and np.isfinite(got).all() and (np.abs(got) <= 1).all()
    model, proc = ClapModel.from_pretrained(str(tiny_clap)).eval(), ClapProcessor.from_pretrained(str(tiny_clap))
    mono = [read_wav(m["soundtrack"])[0].astype(np.float64).mean(0) for m in metas]
    with torch.no_grad():
        for i in range(4):
            inputs = proc(text=[PROMPTS[i]], audio=[mono[i]], sampling_rate=48_000, return_tensors="pt", padding=True)
            inputs["is_longer"][:] = False  # within the window (the extractor marks one of a batch at random)
            out = model(**inputs)
            cos = float(out.logits_per_audio[0, 0] / model.logit_scale_a.exp())
            assert abs(got[i] - cos) < 1e-5, (i, got[i], cos)
    again = np.concatenate([rs.score(_clips(1), PROMPTS[i:i + 1], metas[i:i + 1], ["x"])["clap_score"] for i in range(4)])
    assert np.allclose(again, got, atol=1e-5)


def test_a_soundtrack_longer_than_the_window_scores_the_same_every_time(tiny_clap):
    rs = RewardSet({"clap_score": 1.0}, {"clap_score": {"path": str(tiny_clap)}})
    metas = _metas(_sounds())
    first = rs.score(_clips(5), PROMPTS, metas, list("abcde"))["clap_score"]
    np.random.seed(123)  # the global generator's state does not reach the score
    assert np.array_equal(rs.score(_clips(5), PROMPTS, metas, list("abcde"))["clap_score"], first)
    assert np.allclose(rs.score(_clips(1), PROMPTS[4:], metas[4:], ["e"])["clap_score"], first[4:], atol=1e-5)


def test_soundtracks_go_in_mono_at_the_extractors_rate():
    x16 = np.arange(16_000) / 16_000
    stereo = np.stack([np.sin(2 * np.pi * 440 * x16), np.sin(2 * np.pi * 440 * x16 + 0.5)])
    up = to_mono_at(stereo, 16_000, 48_000)
    x48 = np.arange(48_000) / 48_000
    want = 0.5 * (np.sin(2 * np.pi * 440 * x48) + np.sin(2 * np.pi * 440 * x48 + 0.5))
    assert up.shape == (48_000,) and np.abs(up[500:-500] - want[500:-500]).max() < 2e-3
    assert np.array_equal(to_mono_at(stereo, 48_000, 48_000), stereo.mean(0))


def test_a_16khz_soundtrack_scores_as_the_same_sound_at_48khz(tiny_clap):
    rs = RewardSet({"clap_score": 1.0}, {"clap_score": {"path": str(tiny_clap)}})

    def tone(rate):
        x = np.arange(rate) / rate
        return np.stack([0.4 * np.sin(2 * np.pi * 330 * x)] * 2).astype(np.float32)

    s16 = rs.score(_clips(1), PROMPTS[:1], _metas([tone(16_000)], 16_000), ["a"])["clap_score"]
    s48 = rs.score(_clips(1), PROMPTS[:1], _metas([tone(48_000)], 48_000), ["a"])["clap_score"]
    assert abs(float(s16[0] - s48[0])) < 5e-3


def test_text_key_scores_the_metadatas_text(tiny_clap):
    rs = RewardSet({"clap_score": 1.0}, {"clap_score": {"path": str(tiny_clap), "text_key": "sound"}})
    metas = [{**m, "sound": p} for m, p in zip(_metas(_sounds()[:3]), PROMPTS[2:5])]
    keyed = rs.score(_clips(3), PROMPTS[:3], metas, list("abc"))["clap_score"]
    plain = RewardSet({"clap_score": 1.0}, {"clap_score": {"path": str(tiny_clap)}})
    assert np.allclose(keyed, plain.score(_clips(3), PROMPTS[2:5], metas, list("abc"))["clap_score"], atol=1e-6)
    assert not np.allclose(keyed, plain.score(_clips(3), PROMPTS[:3], metas, list("abc"))["clap_score"], atol=1e-4)
    with pytest.raises(ValueError, match="text_key='sound'.*unset text_key"):
        rs.check_prompts(PROMPTS[:2], [{"sound": "rain"}, {}])


def test_misuse_is_refused_naming_the_fix(tiny_clap, tmp_path):
    with pytest.raises(ValueError, match="not a CLAP checkpoint.*reward.options.clap_score.path"):
        RewardSet({"clap_score": 1.0}, {"clap_score": {"path": str(tmp_path)}})
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no CLAP feature extractor.*ClapProcessor"):
        RewardSet({"clap_score": 1.0}, {"clap_score": {"path": str(tmp_path)}})
    rs = RewardSet({"clap_score": 1.0, "jpeg_compressibility": 1.0}, {"clap_score": {"path": str(tiny_clap)}})
    with pytest.raises(ValueError, match=r"\['clap_score'\] score a clip's soundtrack.*makes no sound.*ltx2"):
        rs.check_media(video=True, audio=False)
    rs.check_media(video=True, audio=True)
    with pytest.raises(ScoringError, match="scores soundtracks, and 1 sample.*'two blue squares'"):
        rs.score(_clips(2), PROMPTS[:2], [_metas(_sounds()[:1])[0], {}], list("ab"))


def test_pixrl_score_reads_the_wav_beside_each_clip(tiny_clap, tmp_path):
    waves = _sounds(16_000)[:2]
    clips = np.random.default_rng(0).integers(0, 255, (2, 3, 16, 16, 3), dtype=np.uint8)
    for i in range(2):
        (tmp_path / f"{i}.mp4").write_bytes(clip_bytes(clips[i]))
        (tmp_path / f"{i}.wav").write_bytes(wav_bytes(waves[i], 16_000))
        (tmp_path / f"{i}.json").write_text(json.dumps({"prompt": PROMPTS[i]}))
    res = CliRunner().invoke(app, ["score", "--reward", "clap_score", "--images", str(tmp_path),
                                   f"clap_score.path={tiny_clap}"])
    assert res.exit_code == 0, res.output
    got = [json.loads(line)["clap_score"] for line in res.stdout.strip().splitlines()]
    rs = RewardSet({"clap_score": 1.0}, {"clap_score": {"path": str(tiny_clap)}})
    want = rs.score(_clips(2), PROMPTS[:2], _metas(waves, 16_000), list("ab"))["clap_score"]
    assert np.allclose(got, want, atol=1e-6)
    (tmp_path / "1.wav").unlink()
    res = CliRunner().invoke(app, ["score", "--reward", "clap_score", "--images", str(tmp_path),
                                   f"clap_score.path={tiny_clap}"])
    assert res.exit_code != 0 and "1.mp4" in res.output and "have none" in res.output


def test_a_run_of_a_silent_family_with_clap_is_refused_before_anything_is_written(tiny_clap, tmp_path):
    res = CliRunner().invoke(app, ["train", "--iterations", "1", "--run", "silent", f"run.workdir={tmp_path}",
                                   "reward.weights.clap_score=1.0", f"reward.options.clap_score.path={tiny_clap}"])
    assert res.exit_code != 0 and "makes no sound" in res.output and "ltx2" in res.output, res.output
    assert not list(tmp_path.rglob("*.lance"))
