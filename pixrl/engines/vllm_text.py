"""The chain of thought (T2I-R1) sampled by a vLLM server (`sampling.cot_backend=vllm`).

A token family's rollout first samples each sample's reasoning text, then its image tokens after
an image prompt that embeds the text. With this backend the text comes from a vLLM server that
serves the policy's language model as a Llama checkout (models/janus_text.py; `pixrl
serve-vllm-text` starts one), and the image tokens from the policy in this process, as before.

- **Exactly the named version.** Before a rollout the engine calls `sync(family, weights_id)`:
  when the server holds another version, the current in-memory text weights (LoRA merged) move
  to it, then it drops its prefix cache. How (`sampling.cot_vllm_weights`):
  - `broadcast` (default): over a process group of their own, through vLLM's weight-update API
    and pixrl's backend inside the server (engines/vllm_weights.py, vllm_receiver.py); no file,
    no shared disk. The server names the version it holds (`/weight_info`), so rollout workers
    sharing one server move each version once.
  - `files`: written to `weights_dir/<version>.<pid>/model.safetensors` and reloaded in place
    (vLLM's `reload_weights` over `/collective_rpc`); the previous version's file is removed once
    the new one is loaded.
  Both need the server in dev mode (`VLLM_SERVER_DEV_MODE=1`; `pixrl serve-vllm-text` sets it).
- **Log-probs are the policy's.** vLLM returns only the tokens; the stored log-probs are
  teacher-forced by the policy (algorithms/token_sampling.py), the function replay
  differentiates, so the ratio before an update is exactly 1. vLLM's own log-probs of the same
  tokens are stored beside them (`cot_behavior_log_probs`): how far its sampler is from the policy.
- **Reproducible per sample.** Each row is its own request with a seed drawn from the sample's
  generator (the one that then draws its image tokens), so a sample does not depend on its
  batch's other rows' seeds. vLLM does not promise batch-invariant kernels: a generate that is
  rerun after a failure can differ in the last bits of a logit, hence rarely in a token (the
  policy backend reruns bit for bit).
- Text is sampled at `cot_temperature` with no top-k/top-p, until the family's end-of-sentence
  token (kept, as the policy backend keeps it) or the budget.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..rewards.base import ScoringError
from ..rewards.http_post import connect_served, post_json


class CotServerError(RuntimeError):
    """The chain-of-thought server is unreachable, refuses, or answers something unusable."""


class VllmTextSampler:
    def __init__(self, url: str, weights_dir: Path, served_model: str = "", concurrency: int = 16,
                 timeout: float = 300.0, retries: int = 2, token_env: str = "PIXRL_VLLM_TOKEN",
                 moves: str = "broadcast", address: str = ""):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"sampling.cot_backend=vllm needs sampling.cot_vllm_url, the server `pixrl "
                             f"serve-vllm-text` started (e.g. http://127.0.0.1:8000); got {url!r}")
        self.url, self.model, self.weights_dir = url.rstrip("/"), served_model, Path(weights_dir)
        self.concurrency, self.timeout, self.retries = concurrency, timeout, retries
        self.token = os.environ.get(token_env, "")
        if moves not in ("broadcast", "files"):
            raise ValueError(f"sampling.cot_vllm_weights must be broadcast or files; got {moves!r}")
        self.moves, self.address = moves, address
        self.client = None
        self.loaded: str | None = None  # the version the server holds (None: unknown, e.g. what it started with)

    # --- connection and weights ---------------------------------------------------------------
    def setup(self) -> None:
        if self.client is None:
            self.client, self.model = connect_served(
                self.url, self.token, self.timeout, self.model, "sampling.cot_backend=vllm",
                "start one with `pixrl serve-vllm-text` or fix sampling.cot_vllm_url", "sampling.cot_vllm_model",
                CotServerError)

    def _post(self, path: str, payload: dict | None, what: str, retries: int | None = None) -> dict:
        try:
            return post_json(self.client, f"{self.url}{path}", payload or {},
                             self.retries if retries is None else retries, 1.0,
                             f"the chain-of-thought server {self.url} ({what})",
                             "check the server (`pixrl serve-vllm-text`) and sampling.cot_vllm_url")
        except ScoringError as exc:
            hint = ("; the server must run with VLLM_SERVER_DEV_MODE=1 (pixrl serve-vllm-text sets it)"
                    if "404" in str(exc) and path != "/v1/completions" else "")
            raise CotServerError(str(exc) + hint) from None

    def _get(self, path: str) -> dict:
        import httpx

        try:
            r = self.client.get(f"{self.url}{path}")
        except httpx.TransportError as exc:
            raise CotServerError(f"the chain-of-thought server {self.url} is unreachable ({exc})") from None
        if r.status_code != 200:
            dev = "; the server must run with VLLM_SERVER_DEV_MODE=1 (pixrl serve-vllm-text sets it)"
            raise CotServerError(f"the chain-of-thought server {self.url}{path} answered HTTP {r.status_code}"
                                 f"{dev if r.status_code == 404 else ''}")
        return r.json()

    def sync(self, family, weights_id: str) -> None:
        """Make the server's weights the family's current ones (version `weights_id`)."""
        self.setup()
        if self.loaded == weights_id:
            return
        if self._get("/weight_info").get("weight_version") == weights_id:  # another sender moved it
            self.loaded = weights_id
            return
        if self.moves == "broadcast":
            self._broadcast(family, weights_id)
        else:
            self._files(family, weights_id)
        self._post("/reset_prefix_cache", None, "dropping the previous version's cache")
        self.loaded = weights_id

    def _broadcast(self, family, weights_id: str) -> None:
        from ..models.janus_text import text_weights
        from .vllm_weights import WeightPush

        # an init or an update returns once the whole move is done: no retries, which would rejoin a session
        call = lambda path, payload, what: self._post(path, payload, what, retries=0)  # noqa: E731
        WeightPush(self.url, call, self._get, CotServerError, self.address, self.timeout).push(
            text_weights(family), weights_id)

    def _files(self, family, weights_id: str) -> None:
        from ..models.janus_text import write_text_weights

        target = self._dir(weights_id)
        write_text_weights(family, target)
        self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(target)}},
                   f"loading version {weights_id}")
        self._post("/update_weight_version", {"new_version": weights_id}, f"naming version {weights_id}")
        if self.loaded is not None:
            shutil.rmtree(self._dir(self.loaded), ignore_errors=True)

    def _dir(self, weights_id: str) -> Path:
        """This process's copy of a version (rollout workers sharing a server each write their own,
        so none removes a file another is loading)."""
        return self.weights_dir / f"{weights_id.replace('/', '_')}.{os.getpid()}"

    # --- sampling -----------------------------------------------------------------------------
    def _one(self, ids: list[int], seed: int, budget: int, temperature: float, eos: int) -> tuple[list[int], list[float]]:
        resp = self._post("/v1/completions", {
            "model": self.model, "prompt": ids, "max_tokens": budget, "temperature": temperature, "top_p": 1.0,
            "seed": seed, "stop_token_ids": [eos], "logprobs": 0, "return_tokens_as_token_ids": True,
            "skip_special_tokens": False}, "sampling a chain of thought")
        try:
            lp = resp["choices"][0]["logprobs"]
            tokens = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
            return tokens, [float(x) for x in lp["token_logprobs"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise CotServerError(f"the chain-of-thought server {self.url} returned no token ids "
                                 f"(got {str(resp)[:200]}); it must be a vLLM OpenAI server") from None

    def sample(self, text_cond, generators: list[torch.Generator], budget: int, temperature: float,
               pad: int, eos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [B, budget] padded with `pad`, mask [B, budget], 1 = sampled, the server's
        log-probs of them [B, budget], 0 where masked) for the reasoning prompts `text_cond`
        (left-padded ids and mask), one seed per row from its generator."""
        self.setup()
        prompts = [row[m.bool()].tolist() for row, m in zip(text_cond.ids.cpu(), text_cond.mask.cpu())]
        seeds = [int(torch.randint(0, 2 ** 31 - 1, (1,), generator=g, device=g.device)) for g in generators]
        with ThreadPoolExecutor(self.concurrency) as pool:
            got = list(pool.map(lambda a: self._one(a[0], a[1], budget, temperature, eos), zip(prompts, seeds)))
        dev = text_cond.ids.device
        tokens = torch.full((len(got), budget), pad, dtype=torch.long, device=dev)
        mask = torch.zeros((len(got), budget), dtype=torch.long, device=dev)
        behavior = torch.zeros((len(got), budget), dtype=torch.float32, device=dev)
        for r, (toks, lps) in enumerate(got):
            if not 0 < len(toks) == len(lps) <= budget:
                raise CotServerError(f"the chain-of-thought server returned {len(toks)} tokens with {len(lps)} "
                                     f"log-probs for a budget of {budget}")
            tokens[r, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            mask[r, :len(toks)] = 1
            behavior[r, :len(toks)] = torch.tensor(lps, dtype=torch.float32)
        return tokens, mask, behavior
