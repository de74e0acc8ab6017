"""UnifiedReward's pointwise score, as flow_grpo (`unifiedreward_score_sglang`), MixGRPO and
UniRL's reward service read it: a UnifiedReward VLM (Qwen2.5-VL fine-tunes, e.g.
CodeGoat24/UnifiedReward-7b-v1.5, UnifiedReward-2.0-qwen-7b) is shown the image — resized to
`image_size`² (flow_grpo: 512², PIL's bicubic), sent as PNG — and flow_grpo's question with the
prompt as its caption; it answers in words, greedily (temperature 0), ending "Final Score: s"
with s in 1–5. The reward is s / 5; the stored `unified_reward.raw` is s.

Served (`backend=vllm`: any OpenAI-compatible server, vLLM or SGLang, as flow_grpo serves it) or
loaded here from a local checkout (`backend=transformers`, greedy `generate`). An answer without
"Final Score: s" (cut at `max_tokens`, or another model) is not scored 0, as flow_grpo does: the
batch fails, naming the prompt and what the judge said — raise `max_tokens`, or check the model.
"""

from __future__ import annotations

import re

import numpy as np

from .base import ScoringError, register_reward
from .vlm_judge import VlmJudge

# flow_grpo's question (rewards.py, unifiedreward_score_sglang), "<image>\n" included as it sends it
QUESTION = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate "
    "this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with "
    "the provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as "
    "described in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including "
    "clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, "
    "assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]")
FINAL_SCORE = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")


def final_score(answer: str) -> float | None:
    """The first "Final Score: s" (s in 1–5, decimals allowed) of a judge's answer, else None."""
    m = FINAL_SCORE.search(answer)
    return float(m.group(1)) if m else None


def judged_pixels(images: np.ndarray, side: int) -> np.ndarray:
    """uint8 [B, side, side, 3]: each image resized as flow_grpo does (PIL `resize`, bicubic)."""
    from PIL import Image

    return np.stack([np.asarray(Image.fromarray(np.asarray(im, np.uint8)).resize((side, side), Image.BICUBIC))
                     for im in images])


@register_reward("unified_reward")
class UnifiedReward(VlmJudge):
    value_range = (0.2, 1.0)

    def __init__(self, path: str = "", question: str = QUESTION, image_size: int = 512, max_tokens: int = 512,
                 batch_size: int = 8, dtype: str = "float32", backend: str = "transformers", url: str = "",
                 served_model: str = "", concurrency: int = 16):
        if image_size < 28:
            raise ValueError(f"reward {self.name}: image_size={image_size} is below one 28-px vision cell; flow_grpo "
                             "judges at 512")
        if max_tokens < 4:
            raise ValueError(f"reward {self.name}: max_tokens={max_tokens} leaves no room for 'Final Score: s'")
        self.image_size, self.max_tokens = image_size, max_tokens
        super().__init__(path, question, batch_size=batch_size, dtype=dtype, backend=backend, url=url,
                         served_model=served_model, concurrency=concurrency)

    def answers(self, images: np.ndarray, prompts: list[str]) -> list[str]:
        """The judge's greedy answers, one per image, to the question about its prompt."""
        pixels = judged_pixels(images, self.image_size)
        if self.backend == "vllm":
            return self.served_answers(pixels, prompts)
        import torch

        inputs = self.inputs(pixels, prompts)
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=self.max_tokens, do_sample=False)
        new = out[:, inputs["input_ids"].shape[1]:]
        return self.tokenizer.batch_decode(new, skip_special_tokens=True)

    def served_request(self, pixels: np.ndarray, prompt: str) -> dict:
        """The chat completion flow_grpo asks of its server: the resized image (PNG), then the
        question about `prompt`; temperature 0."""
        request = self.vllm.chat_request([pixels], self.question.format(prompt=prompt))
        for key in ("logprobs", "top_logprobs"):
            request.pop(key)
        return {**request, "max_tokens": self.max_tokens}

    def served_answers(self, pixels: np.ndarray, prompts: list[str]) -> list[str]:
        """The served judge's answers, `concurrency` requests at a time (the server batches them)."""
        from concurrent.futures import ThreadPoolExecutor

        from .http_post import post_json

        client = self.vllm

        def ask(image, prompt):
            resp = post_json(client.client, f"{client.url}/v1/chat/completions", self.served_request(image, prompt),
                             client.retries, client.backoff, f"judge server {client.url}",
                             f"check the server and reward.options.{self.name}.url")
            try:
                return resp["choices"][0]["message"]["content"] or ""
            except (KeyError, IndexError, TypeError):
                raise ScoringError(f"judge server {client.url} returned no answer for prompt {prompt!r} "
                                   f"(got {str(resp)[:200]})") from None

        with ThreadPoolExecutor(client.concurrency) as pool:
            return list(pool.map(ask, pixels, prompts))

    def score(self, images, prompts, metadata):
        answers = []
        for s in range(0, len(images), self.batch_size):
            answers += self.answers(images[s:s + self.batch_size], list(prompts[s:s + self.batch_size]))
        scores = [final_score(a) for a in answers]
        missing = [i for i, v in enumerate(scores) if v is None]
        if missing:
            i = missing[0]
            raise ScoringError(f"reward {self.name}: {len(missing)} of {len(answers)} answers hold no 'Final Score: "
                               f"s' (s in 1–5) — e.g. for prompt {prompts[i]!r} the judge said {answers[i][-160:]!r}; "
                               f"raise reward.options.{self.name}.max_tokens (an answer cut short), or check that the "
                               "model is a UnifiedReward judge")
        raw = np.array(scores, np.float32)
        return {self.name: raw / 5.0, f"{self.name}.raw": raw}
