"""The VLM judge's vLLM backend (`reward.options.vlm_judge.backend=vllm`): the same question about
each image, asked of a Qwen-VL model that vLLM serves through its OpenAI-compatible API, and the
same score — p(yes) / (p(yes) + p(no)) of the first answer token, each answer's listed spellings
summed — read from the response's top log-probabilities (greedy, one token, `top_logprobs`
alternatives; vLLM reports them before any sampling transform).

vLLM cannot share pixrl's environment (its pins clash with Prefect's), so it runs from its own:
`pixrl setup-vllm` makes it, and `vllm serve CHECKOUT --max-logprobs 20` serves the judge on a
GPU, on this machine or another. The images travel as PNG data URLs (lossless, so the server
judges the exact pixels); requests go out `concurrency` at a time and vLLM batches them.

A sample whose top alternatives hold neither answer has no defined score: it fails, naming the
sample's prompt and the fix (more `top_logprobs`, another question), rather than scoring 0.
"""

from __future__ import annotations

import base64
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..artifacts.media import png_bytes
from .base import ScoringError
from .http_post import connect_served, post_json


def answer_probs(top_logprobs: list[dict], yes: tuple[str, ...], no: tuple[str, ...]) -> tuple[float, float]:
    """(p(yes), p(no)) from one position's alternatives [{token, logprob}, …] (exact spellings)."""
    py = sum(math.exp(a["logprob"]) for a in top_logprobs if a["token"] in yes)
    pn = sum(math.exp(a["logprob"]) for a in top_logprobs if a["token"] in no)
    return py, pn


class VllmJudgeClient:
    def __init__(self, url: str, served_model: str, question: str, yes: tuple[str, ...], no: tuple[str, ...],
                 top_logprobs: int = 20, concurrency: int = 16, timeout: float = 120.0, retries: int = 4,
                 backoff: float = 1.0, token_env: str = "PIXRL_VLLM_TOKEN"):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward vlm_judge: backend vllm needs url, the server `vllm serve` started (e.g. "
                             f"http://127.0.0.1:8000); got {url!r} — set reward.options.vlm_judge.url")
        self.url, self.model, self.question = url.rstrip("/"), served_model, question
        self.yes, self.no, self.top, self.concurrency = tuple(yes), tuple(no), top_logprobs, concurrency
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.token = os.environ.get(token_env, "")
        self.client = None

    def setup(self) -> None:
        """Connect and find the served model (the only one, or `served_model` among them)."""
        self.client, self.model = connect_served(
            self.url, self.token, self.timeout, self.model, "reward vlm_judge",
            f"start one with `vllm serve CHECKOUT --max-logprobs {self.top}` from the environment `pixrl "
            f"setup-vllm` made, or fix reward.options.vlm_judge.url", "reward.options.vlm_judge.served_model")

    def _request(self, image: np.ndarray, prompt: str) -> dict:
        url = "data:image/png;base64," + base64.b64encode(png_bytes(np.asarray(image, np.uint8))).decode("ascii")
        return {"model": self.model, "max_tokens": 1, "temperature": 0.0, "logprobs": True,
                "top_logprobs": self.top,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": self.question.format(prompt=prompt)}]}]}

    def _one(self, image: np.ndarray, prompt: str) -> tuple[float, float]:
        resp = post_json(self.client, f"{self.url}/v1/chat/completions", self._request(image, prompt), self.retries,
                         self.backoff, f"vLLM judge {self.url}", "check the server (`vllm serve`) and "
                         "reward.options.vlm_judge.url")
        try:
            first = resp["choices"][0]["logprobs"]["content"][0]
        except (KeyError, IndexError, TypeError):
            raise ScoringError(f"vLLM judge {self.url} returned no log-probabilities for {prompt!r} "
                               f"(got {str(resp)[:200]}); serve with --max-logprobs ≥ {self.top}") from None
        py, pn = answer_probs(first.get("top_logprobs") or [first], self.yes, self.no)
        if py + pn == 0.0:
            seen = [a["token"] for a in first.get("top_logprobs", [])][:8]
            raise ScoringError(f"vLLM judge: neither {self.yes} nor {self.no} among the first answer token's top "
                               f"{self.top} for prompt {prompt!r} (it answered {seen}); raise "
                               f"reward.options.vlm_judge.top_logprobs or ask a yes/no question")
        return py, pn

    def answer_probs(self, images: np.ndarray, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            got = list(pool.map(self._one, list(images), list(prompts)))
        return np.array([g[0] for g in got]), np.array([g[1] for g in got])
