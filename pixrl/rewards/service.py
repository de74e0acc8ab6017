"""`pixrl reward-serve`: a reward set behind HTTP, so that model-based scorers live in their own
process (or on their own GPU, or machine) and every run reaches them — as every seed system
serves rewards. `GET /health` names the rewards with their weights, what each takes (image,
clip, soundtrack), the components each stores and the group rewards — what a client's preflight
checks a run against; `POST /score` takes the wire format of
rewards/wire.py and returns every component, exactly what RewardSet.score returns in process.

A bearer token (when set) guards /score (401 without it); a body over the size limit is refused
before it is read (413), as is a request of more images than the batch limit; a malformed
payload is a 422 naming the problem; a scorer failure is a 500 with the ScoringError's message.
Scoring is serialised by a lock (a model is not thread-safe); requests queue, none is dropped —
unless one has waited longer than the queue timeout, which gets a 503 (the client's retry comes
back later). `GET /metrics` reports requests, refusals, failures, images and seconds scored and
the time spent waiting, in Prometheus' text format. FastAPI and uvicorn come with Prefect.

With `accept_pickle` (`--accept-pickle`) the service also answers flow_grpo's clients, which POST
a pickled dict of JPEG bytes to the root URL and read a pickled dict back (rewards/wire.py); the
unpickler takes plain data and numpy arrays only, and the same token, size and batch limits apply.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections import Counter

import numpy as np
from pydantic import BaseModel, Field
from starlette.requests import Request  # at module level: FastAPI resolves the endpoints' string annotations here

from .base import ScoringError
from .compose import RewardSet
from .wire import decode_images, decode_metadata, decode_pickled_request, encode_pickled_response


class ScoreRequest(BaseModel):
    images: list[str] = Field(min_length=1, description="base64 PNG (an image) or MP4 (a clip) per sample")
    prompts: list[str]
    metadata: list[dict] | None = None
    sample_ids: list[str] | None = None
    groups: list[str] | None = None  # each sample's group, for a group reward (pairwise_judge)


class ServiceMetrics:
    """Counters behind GET /metrics (Prometheus text exposition format)."""

    def __init__(self):
        self.counts: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, count: str, n: int = 1, seconds: str | None = None, value: float = 0.0) -> None:
        with self._lock:
            self.counts[count] += n
            if seconds:
                self.seconds[seconds] += value

    def text(self) -> str:
        with self._lock:
            lines = []
            for name, v in sorted(self.counts.items()):
                lines += [f"# TYPE pixrl_reward_{name}_total counter", f"pixrl_reward_{name}_total {v}"]
            for name, v in sorted(self.seconds.items()):
                lines += [f"# TYPE pixrl_reward_{name}_seconds_total counter", f"pixrl_reward_{name}_seconds_total {v:.6f}"]
        return "\n".join(lines) + "\n"


class ScoringGate:
    """The reward set behind one lock (scorers are not thread-safe; requests queue), with the
    service's batch limit, queue timeout and counters. A scorer failure is a 500 naming it."""

    def __init__(self, rewards: RewardSet, stats: "ServiceMetrics", max_batch: int, queue_timeout_s: float):
        self.rewards, self.stats = rewards, stats
        self.max_batch, self.queue_timeout_s = max_batch, queue_timeout_s
        self.lock = threading.Lock()

    def check_batch(self, n: int) -> None:
        from fastapi import HTTPException

        if n > self.max_batch:
            self.stats.add("refused")
            raise HTTPException(413, f"{n} images in one request exceed the batch limit of {self.max_batch}; split "
                                     f"the request (reward.options.remote.batch) or raise --max-batch")

    def score(self, images: np.ndarray, prompts: list[str], meta: list[dict], ids: list[str],
              groups: list[str] | None = None) -> dict:
        from fastapi import HTTPException

        t0 = time.perf_counter()
        if not self.lock.acquire(timeout=self.queue_timeout_s):
            self.stats.add("timed_out")
            raise HTTPException(503, f"waited {self.queue_timeout_s:.0f} s behind other requests; retry later")
        try:
            t1 = time.perf_counter()
            self.stats.add("waits", seconds="queue_wait", value=t1 - t0)
            out = self.rewards.score(images, prompts, meta, ids, groups)
        except ScoringError as exc:
            self.stats.add("failed")
            raise HTTPException(500, str(exc)) from None
        finally:
            self.lock.release()
        self.stats.add("images", len(images), seconds="scoring", value=time.perf_counter() - t1)
        return out


def _add_limits(app, stats: "ServiceMetrics", token: str | None, max_bytes: int, accept_pickle: bool) -> None:
    """The bearer token and the body-size limit, checked before a scoring request is read."""

    @app.middleware("http")
    async def _limits(request: Request, call_next):
        from fastapi.responses import JSONResponse

        if request.url.path == "/score" or (accept_pickle and request.url.path == "/"):
            stats.add("requests")
            if token and not hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {token}"):
                stats.add("refused")
                return JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401)
            size = request.headers.get("content-length")
            if size is not None and int(size) > max_bytes:
                stats.add("refused")
                return JSONResponse({"detail": f"request body of {int(size)} bytes exceeds the limit of {max_bytes}; "
                                               f"send fewer images per request or raise --max-mb"}, status_code=413)
        return await call_next(request)


def _add_pickle_route(app, gate: ScoringGate) -> None:
    """flow_grpo's wire format at `/`: a pickled dict in, a pickled dict out."""
    from fastapi import HTTPException
    from fastapi.responses import Response
    from starlette.concurrency import run_in_threadpool

    @app.post("/")
    async def score_pickled(request: Request) -> Response:
        body = await request.body()
        try:
            images, prompts, meta = decode_pickled_request(body)
        except ValueError as exc:
            gate.stats.add("refused")
            raise HTTPException(422, str(exc)) from None
        gate.check_batch(len(images))
        ids = [f"request[{i}]" for i in range(len(images))]
        out = await run_in_threadpool(gate.score, images, prompts, meta, ids)
        return Response(encode_pickled_response(out), media_type="application/octet-stream")


def build_app(rewards: RewardSet, token: str | None = None, max_bytes: int = 64 << 20, max_batch: int = 256,
              queue_timeout_s: float = 600.0, accept_pickle: bool = False):
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import PlainTextResponse

    app = FastAPI(title="pixrl reward service")
    stats = ServiceMetrics()
    gate = ScoringGate(rewards, stats, max_batch, queue_timeout_s)
    _add_limits(app, stats, token, max_bytes, accept_pickle)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "rewards": rewards.weights, "takes": {n: r.takes for n, r in rewards.rewards.items()},
                "components": {n: list(r.components) for n, r in rewards.rewards.items()},
                "groupwise": [n for n, r in rewards.rewards.items() if r.groupwise]}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> str:
        return stats.text()

    @app.post("/score")
    def score(req: ScoreRequest) -> dict:  # a sync endpoint: FastAPI runs it in its thread pool
        n = len(req.images)
        gate.check_batch(n)
        meta = [decode_metadata(m) for m in req.metadata] if req.metadata is not None else [{}] * n
        ids = req.sample_ids if req.sample_ids is not None else [f"request[{i}]" for i in range(n)]
        if not len(req.prompts) == len(meta) == len(ids) == n or (req.groups is not None and len(req.groups) != n):
            raise HTTPException(422, f"{n} images, {len(req.prompts)} prompts, {len(meta)} metadata, {len(ids)} "
                                     f"sample ids{'' if req.groups is None else f', {len(req.groups)} groups'}: "
                                     f"one of each per image")
        try:
            images = decode_images(req.images)
        except ValueError as exc:
            stats.add("refused")
            raise HTTPException(422, str(exc)) from None
        out = gate.score(images, req.prompts, meta, ids, req.groups)
        return {"scores": {k: np.asarray(v, np.float32).tolist() for k, v in out.items()}}

    if accept_pickle:
        _add_pickle_route(app, gate)
    return app
