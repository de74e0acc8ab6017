"""Video through the stores and the reward contract: clips stored as lossless H.264 RGB in MP4
(exactly F frames back, bit for bit, readable with plain PyAV), animated-PNG grids (repeated and
still frames unfolded), frame-wise image rewards averaged per clip, the temporal-consistency
reward's formula, and clip-only rewards refused for image families."""

import numpy as np
import pytest
from typer.testing import CliRunner

from pixrl.artifacts.media import animated_png, clip_bytes, clip_grid, decode_media, media_bytes, png_bytes
from pixrl.cli import app
from pixrl.rewards.base import ScoringError
from pixrl.rewards.compose import RewardSet
from pixrl.rewards.jpeg import jpeg_kilobytes


def _clips(b=2, f=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (b, f, 16, 16, 3), dtype=np.uint8)


def test_clips_round_trip_bit_exactly_through_mp4():
    import io

    import av

    clip = _clips(1, 6)[0]
    clip[2] = clip[1]  # a repeated frame
    for c in (clip, np.repeat(clip[:1], 4, axis=0)):  # and a clip that never moves
        data = media_bytes(c)
        assert data == clip_bytes(c) and data[4:8] == b"ftyp"
        back = decode_media(data)
        assert back.shape == c.shape and np.array_equal(back, c)
        with av.open(io.BytesIO(data)) as inp:  # a standard decoder, no pixrl code
            plain = np.stack([f.to_ndarray(format="rgb24") for f in inp.decode(video=0)])
        assert np.array_equal(plain, c)
    img = clip[0]
    assert np.array_equal(decode_media(media_bytes(img)), img) and media_bytes(img) == png_bytes(img)
    with pytest.raises(ValueError, match="uint8 \\[F, H, W, 3\\]"):
        clip_bytes(clip.astype(np.float32))


def test_animated_grids_round_trip_with_repeated_and_still_frames():
    clip = _clips(1, 6)[0]
    clip[2] = clip[3] = clip[1]  # the APNG writer folds these into the previous frame's duration
    for c in (clip, np.repeat(clip[:1], 4, axis=0)):  # a still clip is written as one plain frame
        data = animated_png(c)
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert np.array_equal(decode_media(data), c)
    grid = clip_grid(_clips(4, 3), cols=2, pad=2)
    assert grid.shape == (3, 2 * 18 + 2, 2 * 18 + 2, 3)
    assert np.array_equal(decode_media(animated_png(grid)), grid)


def test_image_rewards_score_every_frame_and_average_per_clip():
    clips = _clips()
    rs = RewardSet({"jpeg_compressibility": 1.0})
    out = rs.score(clips, ["a", "b"], [{}, {}], ["s0", "s1"])
    want = [-np.mean([jpeg_kilobytes(f) for f in clip]) for clip in clips]
    assert np.allclose(out["jpeg_compressibility"], want, atol=1e-5) and out["reward"].shape == (2,)


def test_temporal_consistency_formula():
    still = np.repeat(np.random.default_rng(1).integers(0, 256, (1, 1, 8, 8, 3), dtype=np.uint8), 4, axis=1)
    flicker = np.zeros((1, 4, 8, 8, 3), np.uint8)
    flicker[:, 1::2] = 255
    half = np.zeros((1, 4, 8, 8, 3), np.uint8)
    half[:, 1:] = 51  # one step of 0.2, then none
    rs = RewardSet({"temporal_consistency": 1.0})
    out = rs.score(np.concatenate([still, flicker, half]), ["p"] * 3, [{}] * 3, ["a", "b", "c"])
    assert np.allclose(out["temporal_consistency"], [1.0, 0.0, 1 - 0.2 / 3], atol=1e-6)
    assert np.allclose(out["temporal_consistency.max_step"], [0.0, 1.0, 0.2], atol=1e-6)
    with pytest.raises(ScoringError, match="scores clips"):
        rs.score(still[:, 0], ["p"], [{}], ["a"])
    with pytest.raises(ValueError, match="temporal_consistency.*makes images"):
        rs.check_media(video=False)
    rs.check_media(video=True)


def test_preflight_refuses_clip_rewards_and_frames_for_an_image_family(tmp_path):
    for arg, msg in (("reward=shapes_video", "makes images"), ("model.frames=9", "model.frames=9")):
        res = CliRunner().invoke(app, ["train", "--iterations", "1", "--workdir", str(tmp_path / "wd"), arg])
        assert res.exit_code == 2, res.output
        assert msg in " ".join(res.output.split())
        assert not (tmp_path / "wd").exists()
