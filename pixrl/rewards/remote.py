"""`remote`: a reward set served by `pixrl reward-serve`, scored over HTTP. The main value is the
served set's weighted total; each served component comes back as `remote.<name>`. Transient
failures (connection refused or reset, timeouts, 502–504) are retried with exponential backoff up
to `retries` times; then — or at once for any other refusal (401, 413, 422, a scorer's 500) — a
ScoringError names the URL and the cause, and the score stage writes nothing.

`groups=true`: the served set holds a group reward (`pairwise_judge`): requests carry whole groups
and each sample's group key, and the stages hand this reward whole groups.

It takes whatever the family makes, whole (`takes = "media"`): images, or clips with their
soundtracks in the metadata — the service's own RewardSet scores a clip frame-wise for an image
reward, whole for a clip or soundtrack reward, exactly as in process. Before a run (`connect`) it
asks the service's /health what each served reward takes, which components it stores and whether
one is a group reward, so preflight refuses a served clip reward on an image family, a served
soundtrack reward on a silent one, `groups` that disagree with the served set, and
reward.advantage_weights naming a score the service does not store — before anything is written.
"""

from __future__ import annotations

import os

import numpy as np

from .base import Reward, ScoringError, register_reward
from .http_post import detail, post_json
from .wire import encode_batch


@register_reward("remote")
class RemoteReward(Reward):
    takes = "media"

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
        self.served: dict[str, str] = {}  # served reward → what it takes, once connected

    def connect(self) -> None:
        health = self._health()
        if not isinstance(health.get("takes"), dict):
            raise ValueError(f"reward remote: the service at {self.url} does not say what its rewards take (an older "
                             f"`pixrl reward-serve`); restart it with this version of pixrl")
        self.served = {str(n): str(t) for n, t in health["takes"].items()}
        self.components = tuple(self.served) + tuple(f"{n}.{c}" for n, cs in health.get("components", {}).items()
                                                     for c in cs)
        paired = list(health.get("groupwise", []))
        if paired and not self.groupwise:
            raise ValueError(f"reward remote: the service at {self.url} serves group reward(s) {paired}, which compare "
                             f"the samples of a group; set reward.options.remote.groups=true so requests carry whole "
                             f"groups")
        if self.groupwise and not paired:
            raise ValueError(f"reward remote: groups=true, and the service at {self.url} serves no group reward "
                             f"({', '.join(self.served)}); unset reward.options.remote.groups")

    def _health(self) -> dict:
        import httpx

        fix = "start it with `pixrl reward-serve`, or fix reward.options.remote.url"
        try:
            r = httpx.get(f"{self.url}/health", timeout=min(self.timeout, 30.0))
        except httpx.TransportError as exc:
            raise ValueError(f"reward remote: no reward service answers at {self.url} ({type(exc).__name__}: "
                             f"{exc}); {fix}") from None
        if r.status_code != 200:
            raise ValueError(f"reward remote: {self.url}/health answered HTTP {r.status_code} {detail(r)}; {fix}")
        return r.json()

    def scorers(self) -> dict[str, str]:
        return {f"{self.name}.{n}": t for n, t in self.served.items()} or super().scorers()

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
