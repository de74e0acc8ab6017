"""The `remote` reward on clips with soundtracks, against a real `pixrl reward-serve` serving an
image reward (JPEG compressibility, frame-wise on clips), a clip reward (temporal consistency)
and a soundtrack reward (CLAP on a tiny random checkpoint): clips travel whole with their
soundtracks and score exactly as the same set in process; /health says what each served reward
takes, and preflight refuses — naming the served reward and the fix — what the served set cannot
score for a family, `groups` that disagree with it, advantage weights on scores it does not
store, and a service that does not answer."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import start_reward_service
from pixrl.artifacts.media import wav_bytes
from pixrl.cli import app
from pixrl.rewards.clap_tiny import write_tiny_clap
from pixrl.rewards.compose import RewardSet

WEIGHTS = {"jpeg_compressibility": 1.0, "temporal_consistency": 0.5, "clap_score": 0.5}
PROMPTS = ["rain on a roof", "a bell rings twice", "a dog barks at a bird"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def clap_dir(tmp_path_factory):
    return write_tiny_clap(tmp_path_factory.mktemp("clap") / "clap", seed=0)


@pytest.fixture(scope="module")
def server(clap_dir):
    proc, url = start_reward_service(",".join(f"{n}:{w}" for n, w in WEIGHTS.items()), f"clap_score.path={clap_dir}")
    yield url
    proc.terminate()
    proc.wait(10)


def _sounding_clips(n=3, frames=4, size=16, rate=16_000):
    """Clips that move (a bar sliding across noise) with a different tone each."""
    rng = np.random.default_rng(0)
    clips = rng.integers(0, 64, (n, frames, size, size, 3), dtype=np.uint8)
    for i in range(n):
        for f in range(frames):
            clips[i, f, :, (2 * f + i) % size] = 255
    t = np.arange(rate // 2) / rate
    metas = [{"soundtrack": wav_bytes(np.stack([0.4 * np.sin(2 * np.pi * (220 + 110 * i) * t)] * 2).astype(np.float32),
                                      rate)} for i in range(n)]
    return clips, metas


def _remote_set(url: str, **options) -> RewardSet:
    return RewardSet({"remote": 1.0}, {"remote": {"url": url, **options}})


def test_health_says_what_each_served_reward_takes(server):
    import httpx

    health = httpx.get(f"{server}/health").json()
    assert health["rewards"] == WEIGHTS and health["groupwise"] == []
    assert health["takes"] == {"jpeg_compressibility": "image", "temporal_consistency": "clip",
                               "clap_score": "soundtrack"}
    rs = _remote_set(server)
    assert rs.rewards["remote"].scorers() == {"remote": "media"}  # not yet asked
    rs.connect()
    assert rs.rewards["remote"].scorers() == {f"remote.{n}": t for n, t in health["takes"].items()}


@pytest.mark.parametrize("payload", ["png", "npz"])
def test_clips_and_their_soundtracks_score_as_in_process(server, clap_dir, payload):
    clips, metas = _sounding_clips()
    ids = [f"s{i}" for i in range(len(clips))]
    local = RewardSet(WEIGHTS, {"clap_score": {"path": str(clap_dir)}}).score(clips, PROMPTS, metas, ids)
    served = _remote_set(server, payload=payload).score(clips, PROMPTS, metas, ids)
    assert np.allclose(served["remote"], local["reward"], atol=1e-6, rtol=0)
    for key in ("jpeg_compressibility", "temporal_consistency", "temporal_consistency.max_step", "clap_score"):
        assert np.allclose(served[f"remote.{key}"], local[key], atol=1e-6, rtol=0), key
    assert np.ptp(local["temporal_consistency"]) > 0 and np.ptp(local["clap_score"]) > 0  # the scores tell clips apart
    # a frame-wise client (what `remote` was) cannot give the clip reward its clip
    with pytest.raises(Exception, match="temporal_consistency"):
        RewardSet({"temporal_consistency": 1.0}).score(clips.reshape(-1, 16, 16, 3), PROMPTS * 4, metas * 4,
                                                       [str(i) for i in range(12)])


def test_preflight_refuses_what_the_served_set_cannot_score(server):
    rs = _remote_set(server)
    rs.connect()
    with pytest.raises(ValueError, match=r"remote\.temporal_consistency.*makes images"):
        rs.check_media(video=False)
    with pytest.raises(ValueError, match=r"remote\.clap_score.*makes no sound"):
        rs.check_media(video=True, audio=False)
    rs.check_media(video=True, audio=True)
    rs.check_advantage_parts({"remote.clap_score": 1.0, "remote.temporal_consistency": 0.5})
    with pytest.raises(ValueError, match=r"'remote\.hpsv2' is not a score these rewards store.*remote\.clap_score"):
        rs.check_advantage_parts({"remote.hpsv2": 1.0})
    with pytest.raises(ValueError, match="serves no group reward.*unset reward.options.remote.groups"):
        _remote_set(server, groups=True).connect()
    dead = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(ValueError, match=rf"no reward service answers at {dead}.*pixrl reward-serve"):
        _remote_set(dead).connect()


def test_a_run_of_an_image_family_against_a_served_clip_reward_is_refused_before_anything_is_written(server, tmp_path):
    res = CliRunner().invoke(app, ["train", "--iterations", "1", "--run", "served", f"run.workdir={tmp_path}",
                                   "reward=remote", f"reward.options.remote.url={server}"])
    assert res.exit_code != 0 and "remote.temporal_consistency" in res.output and "makes images" in res.output, res.output
    assert not list(tmp_path.rglob("*.lance"))
