"""POST with bounded retries, shared by the rewards that score over HTTP (the reward service's
client, a vLLM-served judge): transient failures — connection refused or reset, timeouts,
502–504 — are retried with exponential backoff; any other refusal, or running out of attempts,
is a ScoringError naming the URL, the cause and the fix. `connect_served` opens a client on an
OpenAI-compatible server (vLLM) and finds the model it serves."""

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


def connect_served(url: str, token: str, timeout: float, model: str, what: str, start: str, setting: str,
                   error: type[Exception] = ScoringError):
    """(httpx client, served model id) for the OpenAI-compatible server at `url`: `model`, or the
    only model served when it is empty. `what` names the user in messages, `start` says how to
    start a server, `setting` is the option that names the model; failures raise `error`."""
    import httpx

    client = httpx.Client(timeout=timeout, headers={"authorization": f"Bearer {token}"} if token else {})
    try:
        r = client.get(f"{url}/v1/models")
    except httpx.TransportError as exc:
        client.close()
        raise error(f"{what}: no vLLM server answers at {url} ({exc}); {start}") from None
    if r.status_code != 200:
        client.close()
        raise error(f"{what}: {url}/v1/models answered HTTP {r.status_code} {detail(r)}")
    served = [m["id"] for m in r.json().get("data", [])]
    if not model and len(served) == 1:
        model = served[0]
    if model not in served:
        client.close()
        raise error(f"{what}: {url} serves {served}, not {model!r}; set {setting} to one of them")
    return client, model
