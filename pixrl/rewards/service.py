"""`pixrl reward-serve`: a reward set behind HTTP, so that model-based scorers live in their own
process (or on their own GPU, or machine) and every run reaches them — as every seed system
serves rewards. `GET /health` names the rewards; `POST /score` takes the wire format of
rewards/wire.py and returns every component, exactly what RewardSet.score returns in process.

A bearer token (when set) guards /score (401 without it); a body over the size limit is refused
before it is read (413); a malformed payload is a 422 naming the problem; a scorer failure is a
500 with the ScoringError's message. Scoring is serialised by a lock (a model is not
thread-safe); requests queue, none is dropped. FastAPI and uvicorn come with Prefect.
"""

from __future__ import annotations

import hmac
import threading

import numpy as np
from pydantic import BaseModel, Field

from .base import ScoringError
from .compose import RewardSet
from .wire import decode_images


class ScoreRequest(BaseModel):
    images: list[str] = Field(min_length=1, description="base64 PNG (an image) or MP4 (a clip) per sample")
    prompts: list[str]
    metadata: list[dict] | None = None
    sample_ids: list[str] | None = None


def build_app(rewards: RewardSet, token: str | None = None, max_bytes: int = 64 << 20):
    from fastapi import FastAPI, HTTPException, Request

    app = FastAPI(title="pixrl reward service")
    lock = threading.Lock()

    @app.middleware("http")
    async def _limits(request: Request, call_next):
        from fastapi.responses import JSONResponse

        if request.url.path == "/score":
            if token and not hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {token}"):
                return JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401)
            size = request.headers.get("content-length")
            if size is not None and int(size) > max_bytes:
                return JSONResponse({"detail": f"request body of {int(size)} bytes exceeds the limit of {max_bytes}; "
                                               f"send fewer images per request or raise --max-mb"}, status_code=413)
        return await call_next(request)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "rewards": rewards.weights}

    @app.post("/score")
    def score(req: ScoreRequest) -> dict:  # a sync endpoint: FastAPI runs it in its thread pool
        n = len(req.images)
        meta = req.metadata if req.metadata is not None else [{}] * n
        ids = req.sample_ids if req.sample_ids is not None else [f"request[{i}]" for i in range(n)]
        if not len(req.prompts) == len(meta) == len(ids) == n:
            raise HTTPException(422, f"{n} images, {len(req.prompts)} prompts, {len(meta)} metadata, {len(ids)} "
                                     f"sample ids: one of each per image")
        try:
            images = decode_images(req.images)
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None
        with lock:
            try:
                out = rewards.score(images, req.prompts, meta, ids)
            except ScoringError as exc:
                raise HTTPException(500, str(exc)) from None
        return {"scores": {k: np.asarray(v, np.float32).tolist() for k, v in out.items()}}

    return app
