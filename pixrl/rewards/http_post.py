"""POST with bounded retries, shared by the rewards that score over HTTP (the reward service's
client, a vLLM-served judge): transient failures — connection refused or reset, timeouts,
502–504 — are retried with exponential backoff; any other refusal, or running out of attempts,
is a ScoringError naming the URL, the cause and the fix."""

from __future__ import annotations

import time

from .base import ScoringError

TRANSIENT_STATUS = {502, 503, 504}


def detail(r) -> str:
    """The refusal's own words: its JSON `detail` (FastAPI) or `message` (OpenAI-style), else the text."""
    try:
        body = r.json()
    except ValueError:
        return r.text[:200]
    return str(body.get("detail") or body.get("message") or body) if isinstance(body, dict) else str(body)[:200]


def post_json(client, url: str, payload: dict, retries: int, backoff: float, name: str, fix: str) -> dict:
    """The response's JSON. `name`: the server in messages; `fix`: what the user does when it
    stays unreachable."""
    import httpx

    last = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            r = client.post(url, json=payload)
        except httpx.TransportError as exc:  # refused, reset, timed out: the service may come back
            last = f"{type(exc).__name__}: {exc}"
            continue
        if r.status_code in TRANSIENT_STATUS:
            last = f"HTTP {r.status_code}"
            continue
        if r.status_code != 200:
            raise ScoringError(f"{name} refused the batch: HTTP {r.status_code} {detail(r)}")
        return r.json()
    raise ScoringError(f"{name} unreachable after {retries + 1} attempts ({last}); {fix}")
