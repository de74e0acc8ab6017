"""`remote`: a reward set served by `pixrl reward-serve`, scored over HTTP. The main value is the
served set's weighted total; each served component comes back as `remote.<name>`. Transient
failures (connection refused or reset, timeouts, 502–504) are retried with exponential backoff up
to `retries` times; then — or at once for any other refusal (401, 413, 422, a scorer's 500) — a
ScoringError names the URL and the cause, and the score stage writes nothing.

`groups=true`: the served set holds a group reward (`pairwise_judge`): requests carry whole groups
and each sample's group key, and the stages hand this reward whole groups.
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
                 retries: int = 4, backoff: float = 1.0, batch: int = 32, payload: str = "png", groups: bool = False):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward remote: url {url!r} is not an http(s) URL; set reward.options.remote.url to the "
                             f"service `pixrl reward-serve` prints, e.g. http://127.0.0.1:8765")
        self.url, self.timeout, self.retries, self.backoff, self.batch = url.rstrip("/"), timeout, retries, backoff, batch
        if payload not in ("png", "npz"):
            raise ValueError(f"reward remote: payload {payload!r}; choose png (compressed) or npz (raw arrays, no "
                             f"encode cost)")
        self.payload = payload
        self.groupwise = bool(groups)
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

    def score(self, images, prompts, metadata, groups=None):
        parts: dict[str, list] = {}
        for lo, hi in self._requests(len(images), groups):
            body = encode_batch(images[lo:hi], prompts[lo:hi], metadata[lo:hi], self.payload)
            if groups is not None:
                body["groups"] = list(groups[lo:hi])
            for k, v in self._post(body).items():
                parts.setdefault(k, []).extend(v)
        if "reward" not in parts:
            raise ScoringError(f"reward service {self.url} returned no total 'reward' (got {sorted(parts)})")
        out = {self.name: np.asarray(parts.pop("reward"), np.float32)}
        out.update({f"{self.name}.{k}": np.asarray(v, np.float32) for k, v in parts.items()})
        return out


    def _requests(self, n: int, groups) -> list[tuple[int, int]]:
        """Row ranges of `batch` rows, or (with groups) of whole groups, at least `batch` rows unless
        the rows run out (the stages give a group's rows together)."""
        if groups is None:
            return [(s, min(s + self.batch, n)) for s in range(0, n, self.batch)]
        out, lo = [], 0
        for i in range(1, n + 1):
            if i == n or (groups[i] != groups[i - 1] and i - lo >= self.batch):
                out.append((lo, i))
                lo = i
        return out
