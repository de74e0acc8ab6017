"""`pixrl reward-serve` and the `remote` reward against a real server on 127.0.0.1: the same
scores as in process, 401/413/422 refusals with messages, no request lost under 8 concurrent
clients, a dead server → bounded retries then an error naming the URL, and a 2-iteration run of
the miniature with reward=remote storing exactly the in-process rewards."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import start_reward_service
from pixrl.datasets.shapes.prompts import parse
from pixrl.datasets.shapes.render import render_prompt
from pixrl.rewards.base import ScoringError, build_reward
from pixrl.rewards.compose import RewardSet
from pixrl.rewards.wire import encode_batch

TOKEN = "s3cret"
PROMPTS = ["a red circle", "two blue squares", "a green triangle and a yellow square", "three circles"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(*extra: str) -> tuple[subprocess.Popen, str]:
    return start_reward_service("shapes,jpeg_compressibility:0.5", *extra)


@pytest.fixture(scope="module")
def server():
    proc, url = _serve("--token", TOKEN, "--max-mb", "1", "--max-batch", "4")
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def batch():
    images = np.stack([render_prompt(parse(p), i) for i, p in enumerate(PROMPTS)])
    return images, PROMPTS, [parse(p) for p in PROMPTS]


def _remote(url: str, **kw):
    r = build_reward("remote", url=url, token=TOKEN, **kw)
    r.ensure_setup("cpu")
    return r


def test_served_scores_equal_in_process_scores(server, batch):
    images, prompts, meta = batch
    local = RewardSet({"shapes": 1.0, "jpeg_compressibility": 0.5}).score(images, prompts, meta, list("abcd"))
    remote = _remote(server, batch=3).score(images, prompts, meta)  # two requests
    assert np.array_equal(remote["remote"], local["reward"])
    for key in ("shapes", "shapes.correct", "shapes.partial", "jpeg_compressibility"):
        assert np.array_equal(remote[f"remote.{key}"], local[key])
    import httpx

    health = httpx.get(f"{server}/health").json()
    assert health["rewards"] == {"shapes": 1.0, "jpeg_compressibility": 0.5}
    assert health["takes"] == {"shapes": "image", "jpeg_compressibility": "image"} and health["groupwise"] == []
    raw = _remote(server, batch=3, payload="npz").score(images, prompts, meta)  # raw arrays: lossless too
    assert all(np.array_equal(raw[k], remote[k]) for k in remote)


def test_an_npz_sample_must_be_one_uint8_image(server, batch):
    import base64
    import io

    import httpx

    images, prompts, _ = batch
    buf = io.BytesIO()
    np.savez(buf, sample=images[0].astype(np.float32))
    body = {"images": [base64.b64encode(buf.getvalue()).decode()], "prompts": prompts[:1]}
    r = httpx.post(f"{server}/score", json=body, headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 422 and "images[0]" in r.text and "uint8" in r.text


def test_refusals_name_the_problem(server, batch):
    import httpx

    images, prompts, meta = batch
    body = encode_batch(images[:1], prompts[:1], meta[:1])
    auth = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.post(f"{server}/score", json=body).status_code == 401
    assert httpx.post(f"{server}/score", json=body, headers={"authorization": "Bearer nope"}).status_code == 401
    big = httpx.post(f"{server}/score", json={**body, "pad": "x" * (2 << 20)}, headers=auth)
    assert big.status_code == 413 and "exceeds the limit" in big.json()["detail"]
    bad = httpx.post(f"{server}/score", json={**body, "images": ["not base64!"]}, headers=auth)
    assert bad.status_code == 422 and "images[0] is not a base64 PNG" in bad.json()["detail"]
    short = httpx.post(f"{server}/score", json={**body, "prompts": []}, headers=auth)
    assert short.status_code == 422 and "one of each per image" in short.json()["detail"]
    assert httpx.post(f"{server}/score", json={"prompts": ["x"]}, headers=auth).status_code == 422
    with pytest.raises(ScoringError, match="HTTP 500 .*no shapes metadata"):  # a scorer's failure, named
        _remote(server).score(images[:1], ["free text"], [{}])
    five = np.concatenate([images, images[:1]]), [*prompts, prompts[0]], [*meta, meta[0]]
    many = httpx.post(f"{server}/score", json=encode_batch(*five), headers=auth)  # 5 > --max-batch 4
    assert many.status_code == 413 and "batch limit of 4" in many.json()["detail"]


def test_metrics_count_requests_refusals_and_images(server, batch):
    import httpx

    def counters() -> dict[str, float]:
        text = httpx.get(f"{server}/metrics").text
        return {k: float(v) for k, v in (ln.split() for ln in text.splitlines() if ln and not ln.startswith("#"))}

    images, prompts, meta = batch
    before = counters()
    _remote(server, batch=2).score(images[:3], prompts[:3], meta[:3])  # two requests: 2 + 1 images
    assert httpx.post(f"{server}/score", json=encode_batch(images[:1], prompts[:1], meta[:1])).status_code == 401
    after = counters()
    delta = lambda k: after.get(f"pixrl_reward_{k}_total", 0) - before.get(f"pixrl_reward_{k}_total", 0)  # noqa: E731
    assert delta("requests") == 3 and delta("refused") == 1 and delta("images") == 3
    assert after["pixrl_reward_scoring_seconds_total"] > before.get("pixrl_reward_scoring_seconds_total", 0)


def test_concurrent_clients_lose_no_request(server, batch):
    import httpx

    images, prompts, meta = batch
    want = RewardSet({"shapes": 1.0, "jpeg_compressibility": 0.5}).score(images, prompts, meta, list("abcd"))["reward"]
    results, errors = {}, []

    def client(c: int) -> None:
        with httpx.Client(headers={"authorization": f"Bearer {TOKEN}"}, timeout=120) as h:
            for k in range(50):
                i = (c + k) % 4
                r = h.post(f"{server}/score", json=encode_batch(images[i:i + 1], prompts[i:i + 1], meta[i:i + 1]))
                if r.status_code != 200:
                    errors.append(r.status_code)
                    continue
                results[(c, k)] = (i, r.json()["scores"]["reward"][0])

    threads = [threading.Thread(target=client, args=(c,)) for c in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 400
    assert all(np.float32(v) == want[i] for i, v in results.values())


def test_a_dead_server_is_retried_then_named(batch):
    images, prompts, meta = batch
    proc, url = _serve()
    r = build_reward("remote", url=url, retries=2, backoff=0.05)
    r.ensure_setup("cpu")
    assert r.score(images[:1], prompts[:1], meta[:1])["remote"].shape == (1,)
    proc.kill()
    proc.wait(10)
    t0 = time.time()
    with pytest.raises(ScoringError, match=rf"reward service {url} unreachable after 3 attempts"):
        r.score(images[:1], prompts[:1], meta[:1])
    assert time.time() - t0 < 30


def test_a_run_with_the_remote_reward_stores_the_in_process_rewards(server, tmp_path, prefect_harness):
    import lance
    from typer.testing import CliRunner

    from pixrl.cli import app

    common = ["train", "--iterations", "2", "sampling.group_size=2", "sampling.prompts_per_iteration=2",
              "sampling.micro_batch=4", "run.eval_every=0"]

    def run(name: str, *reward: str):
        res = CliRunner().invoke(app, [*common, "--run", name, "--workdir", str(tmp_path / name), *reward])
        assert res.exit_code == 0, res.output
        out = json.loads(res.stdout.strip().splitlines()[-1])
        return lance.dataset(out["table_uri"]).to_table(columns=["sample_id", "reward", "rewards"]).sort_by("sample_id")

    local = run("local", "reward.weights={shapes: 1.0, jpeg_compressibility: 0.5}")
    remote = run("remote", "reward=remote", f"reward.options.remote.url={server}", f"reward.options.remote.token={TOKEN}")
    assert local["reward"].equals(remote["reward"])
    comps = {d["name"]: d["value"] for d in remote["rewards"][0].as_py()}
    assert {"remote.shapes", "remote.jpeg_compressibility"} <= set(comps)


class _RunsCode:
    """What a hostile pickle looks like: unpickling it would call os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _jpegs(images: np.ndarray) -> list[bytes]:
    import io

    from PIL import Image

    out = []
    for im in images:
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, format="JPEG")
        out.append(buf.getvalue())
    return out


def test_the_pickle_wire_format_is_refused_unless_enabled(server, batch):
    import pickle

    import httpx

    images, prompts, _ = batch
    body = pickle.dumps({"images": _jpegs(images[:1]), "prompts": prompts[:1]})
    r = httpx.post(f"{server}/", content=body, headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code in (404, 405)


def test_a_flow_grpo_client_is_answered_and_a_hostile_pickle_runs_nothing(batch, tmp_path):
    """--accept-pickle: flow_grpo's request (a pickled dict of JPEG bytes, prompts as a numpy
    array) gets the in-process scores of the JPEG-decoded images back as a pickled dict; a pickle
    that names any other global is a 422 and its code never runs."""
    import io
    import pickle

    import httpx
    from PIL import Image

    proc, url = _serve("--accept-pickle")
    try:
        images, prompts, meta = batch
        jpegs = _jpegs(images)
        body = pickle.dumps({"images": jpegs, "prompts": np.array(prompts), "meta_datas": meta})
        r = httpx.post(f"{url}/", content=body, timeout=60)
        assert r.status_code == 200, r.text
        got = pickle.loads(r.content)
        seen = np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in jpegs])
        local = RewardSet({"shapes": 1.0, "jpeg_compressibility": 0.5}).score(seen, prompts, meta, list("abcd"))
        assert np.array_equal(np.float32(got["scores"]), local["reward"]) and got["outputs"] == got["scores"]
        assert np.array_equal(np.float32(got["components"]["shapes"]), local["shapes"])

        marker = tmp_path / "ran"
        r = httpx.post(f"{url}/", content=pickle.dumps({"images": jpegs[:1], "x": _RunsCode(marker)}), timeout=30)
        assert r.status_code == 422 and "system" in r.json()["detail"] and "only plain data" in r.json()["detail"]
        assert not marker.exists()
        r = httpx.post(f"{url}/", content=b"not a pickle", timeout=30)
        assert r.status_code == 422
    finally:
        proc.terminate()
        proc.wait(10)
