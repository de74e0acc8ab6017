"""`remote`: a reward set served by `pixrl reward-serve`, scored over HTTP. The main value is the
served set's weighted total; each served component comes back as `remote.<name>`. Transient
failures (connection refused or reset, timeouts, 502–504) are retried with exponential backoff up
to `retries` times; then — or at once for any other refusal (401, 413, 422, a scorer's 500) — a
ScoringError names the URL and the cause, and the score stage writes nothing.
"""

from __future__ import annotations

import os

import numpy as np

from .base import Reward, ScoringError, register_reward
from .http_post import post_json
from .wire import encode_batch


@register_reward("remote")
class RemoteReward(Reward):
    def __init__(self, url: str = "", token: str = "", token_env: str = "PIXRL_REWARD_TOKEN", timeout: float = 300.0,
                 retries: int = 4, backoff: float = 1.0, batch: int = 32, payload: str = "png"):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward remote: url {url!r} is not an http(s) URL; set reward.options.remote.url to the "
                             f"service `pixrl reward-serve` prints, e.g. http://127.0.0.1:8765")
        self.url, self.timeout, self.retries, self.backoff, self.batch = url.rstrip("/"), timeout, retries, backoff, batch
        if payload not in ("png", "npz"):
            raise ValueError(f"reward remote: payload {payload!r}; choose png (compressed) or npz (raw arrays, no "
                             f"encode cost)")
        self.payload = payload
        self.token = token or os.environ.get(token_env, "")
        self.client = None

    def setup(self, device: str = "cpu") -> None:
        import httpx

        super().setup(device)
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        self.client = httpx.Client(timeout=self.timeout, headers=headers)

    def _post(self, payload: dict) -> dict:
        return post_json(self.client, f"{self.url}/score", payload, self.retries, self.backoff,
                         f"reward service {self.url}",
                         "start it with `pixrl reward-serve`, or fix reward.options.remote.url")["scores"]

    def score(self, images, prompts, metadata):
        parts: dict[str, list] = {}
        for s in range(0, len(images), self.batch):
            got = self._post(encode_batch(images[s:s + self.batch], prompts[s:s + self.batch], metadata[s:s + self.batch],
                                          self.payload))
            for k, v in got.items():
                parts.setdefault(k, []).extend(v)
        if "reward" not in parts:
            raise ScoringError(f"reward service {self.url} returned no total 'reward' (got {sorted(parts)})")
        out = {self.name: np.asarray(parts.pop("reward"), np.float32)}
        out.update({f"{self.name}.{k}": np.asarray(v, np.float32) for k, v in parts.items()})
        return out

