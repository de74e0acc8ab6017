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
                 backoff: float = 1.0, token_env: str = "PIXRL_VLLM_TOKEN", name: str = "vlm_judge"):
        """`name`: the reward this client asks for, named in its messages."""
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward {name}: backend vllm needs url, the server `vllm serve` started (e.g. "
                             f"http://127.0.0.1:8000); got {url!r} — set reward.options.{name}.url")
        self.name = name
        self.url, self.model, self.question = url.rstrip("/"), served_model, question
        self.yes, self.no, self.top, self.concurrency = tuple(yes), tuple(no), top_logprobs, concurrency
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.token = os.environ.get(token_env, "")
        self.client = None

    def setup(self) -> None:
        """Connect and find the served model (the only one, or `served_model` among them)."""
        self.client, self.model = connect_served(
            self.url, self.token, self.timeout, self.model, f"reward {self.name}",
            f"start one with `vllm serve CHECKOUT --max-logprobs {self.top}` from the environment `pixrl "
            f"setup-vllm` made, or fix reward.options.{self.name}.url", f"reward.options.{self.name}.served_model")

    def chat_request(self, images: list[np.ndarray], text: str, captions: tuple[str, ...] = ()) -> dict:
        """One user turn: the images (each after its caption, when given), then the text."""
        content = []
        for k, image in enumerate(images):
            if captions:
                content.append({"type": "text", "text": captions[k]})
            url = "data:image/png;base64," + base64.b64encode(png_bytes(np.asarray(image, np.uint8))).decode("ascii")
            content.append({"type": "image_url", "image_url": {"url": url}})
        return {"model": self.model, "max_tokens": 1, "temperature": 0.0, "logprobs": True,
                "top_logprobs": self.top, "messages": [{"role": "user", "content": [*content, {"type": "text",
                                                                                                "text": text}]}]}

    def first_token_probs(self, request: dict, first: tuple[str, ...], second: tuple[str, ...],
                          what: str) -> tuple[float, float]:
        """(p(first), p(second)) of the answer's first token; `what` names the sample in errors."""
        resp = post_json(self.client, f"{self.url}/v1/chat/completions", request, self.retries,
                         self.backoff, f"vLLM judge {self.url}", "check the server (`vllm serve`) and "
                         f"reward.options.{self.name}.url")
        try:
            head = resp["choices"][0]["logprobs"]["content"][0]
        except (KeyError, IndexError, TypeError):
            raise ScoringError(f"vLLM judge {self.url} returned no log-probabilities for {what} "
                               f"(got {str(resp)[:200]}); serve with --max-logprobs ≥ {self.top}") from None
        p1, p2 = answer_probs(head.get("top_logprobs") or [head], first, second)
        if p1 + p2 == 0.0:
            seen = [a["token"] for a in head.get("top_logprobs", [])][:8]
            raise ScoringError(f"vLLM judge: neither {first} nor {second} among the first answer token's top "
                               f"{self.top} for {what} (it answered {seen}); raise reward.options.{self.name}.top_logprobs "
                               f"or ask a question with those answers")
        return p1, p2

    def ask(self, requests: list[dict], first: tuple[str, ...], second: tuple[str, ...],
            what: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Many requests, `concurrency` at a time (vLLM batches them), in order."""
        with ThreadPoolExecutor(self.concurrency) as pool:
            got = list(pool.map(lambda r, w: self.first_token_probs(r, first, second, w), requests, what))
        return np.array([g[0] for g in got]), np.array([g[1] for g in got])

    def answer_probs(self, images: np.ndarray, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        requests = [self.chat_request([img], self.question.format(prompt=p)) for img, p in zip(images, prompts)]
        return self.ask(requests, self.yes, self.no, [f"prompt {p!r}" for p in prompts])
