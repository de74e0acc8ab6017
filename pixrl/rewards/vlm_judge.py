"""A VLM judge: a Qwen2.5-VL / Qwen3-VL instruct model from a local checkout (transformers layout)
is asked a yes/no question about each image — `question`, with {prompt} — and the reward is the
probability of "yes" against "no" in its first answer token: p(yes) / (p(yes) + p(no)), from the
model's own logits (every listed spelling of each answer summed), no sampling, so the score is
deterministic. VeRL-Omni and ReasonGen-R1 judge with Qwen-VL models the same way, by prompting.

The inputs are built as Qwen's processor builds them — chat template with the image placeholder,
the placeholder expanded to the image's patch count (grid t·h·w / merge²), Qwen2VLImageProcessor
pixels — from the checkout's tokenizer and image processor, without the processor class (it
insists on a video processor, which needs torchvision). Rows are left-padded; a batch scores as
its images alone to float precision.

`backend=vllm` asks the same question of the model served by vLLM (rewards/vlm_judge_vllm.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .base import Reward, ScoringError, register_reward

DEFAULT_QUESTION = "Does this image show {prompt}? Answer yes or no."


@register_reward("vlm_judge")
class VlmJudge(Reward):
    value_range = (0.0, 1.0)
    ANSWERS = "yes / .no"  # the options that list the answers' spellings

    def __init__(self, path: str = "", question: str = DEFAULT_QUESTION, yes: tuple[str, ...] = ("Yes", "yes"),
                 no: tuple[str, ...] = ("No", "no"), batch_size: int = 8, dtype: str = "float32",
                 backend: str = "transformers", url: str = "", served_model: str = "", top_logprobs: int = 20,
                 concurrency: int = 16):
        self.question, self.batch_size, self.dtype = question, batch_size, dtype
        self.yes_words, self.no_words = tuple(yes), tuple(no)
        self.locate(path, backend, url, served_model, top_logprobs, concurrency)

    def locate(self, path: str, backend: str, url: str, served_model: str, top_logprobs: int,
               concurrency: int) -> None:
        """Check the settings that say where the judge is: a local checkout, or a vLLM server."""
        if backend not in ("transformers", "vllm"):
            raise ValueError(f"reward {self.name}: backend {backend!r} is not one of transformers, vllm")
        if "{prompt}" not in self.question:
            raise ValueError(f"reward {self.name}: the question must contain {{prompt}} (where the image's prompt goes)")
        self.backend, self.model = backend, None
        if backend == "vllm":  # the model lives in the server: vlm_judge_vllm.py
            from .vlm_judge_vllm import VllmJudgeClient

            self.path = path
            self.vllm = VllmJudgeClient(url, served_model or path, self.question, self.yes_words, self.no_words,
                                        top_logprobs, concurrency, name=self.name)
            return
        p = Path(path) if path else None
        if p is None or not (p / "config.json").is_file() or not (p / "preprocessor_config.json").is_file():
            raise ValueError(f"reward {self.name}: {path!r} is not a Qwen-VL checkout in the transformers layout "
                             f"(config.json and preprocessor_config.json); set reward.options.{self.name}.path to a "
                             f"local copy of e.g. Qwen/Qwen2.5-VL-7B-Instruct (or serve it with vLLM: backend=vllm, "
                             f"url=…)")
        self.path = str(p)

    def setup(self, device: str = "cpu") -> None:
        from transformers import AutoModelForImageTextToText, AutoTokenizer
        from transformers import Qwen2VLImageProcessorPil as ImageProcessor  # the slow one: no torchvision

        super().setup(device)
        if self.backend == "vllm":
            self.vllm.setup()
            return
        try:
            self.model = AutoModelForImageTextToText.from_pretrained(self.path, dtype=getattr(torch, self.dtype))
            self.tokenizer = AutoTokenizer.from_pretrained(self.path, padding_side="left")
            self.images = ImageProcessor.from_pretrained(self.path)
        except Exception as exc:  # transformers raises many types; name the path and the cause
            raise ScoringError(f"reward {self.name}: could not load the judge from {self.path!r}: {exc}") from exc
        self.model.to(device).eval().requires_grad_(False)
        self.image_token = self.tokenizer.convert_ids_to_tokens(self.model.config.image_token_id)
        self.yes, self.no = self._answer_ids(self.yes_words), self._answer_ids(self.no_words)

    def _answer_ids(self, words: tuple[str, ...]) -> list[int]:
        ids = []
        for w in words:
            enc = self.tokenizer.encode(w, add_special_tokens=False)
            if len(enc) != 1:
                raise ScoringError(f"reward {self.name}: the answer {w!r} is {len(enc)} tokens for this tokenizer; "
                                   f"list spellings that are one token each (reward.options.{self.name}.{self.ANSWERS})")
            ids.append(enc[0])
        return ids

    def inputs(self, images: np.ndarray, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The model inputs of a batch: chat texts with each image's placeholder expanded."""
        return self.chat_inputs([[img] for img in images], [self.question.format(prompt=p) for p in prompts])

    def chat_inputs(self, image_sets: list[list[np.ndarray]], texts: list[str],
                    captions: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """One user turn per row: its images (each after its caption, when given), then its text —
        as Qwen's processor builds them (rewards/qwen_vl_inputs.py)."""
        from .qwen_vl_inputs import chat_inputs

        return chat_inputs(self.tokenizer, self.images, self.image_token, image_sets, texts, captions,
                           self.model.device, self.model.dtype)

    @torch.no_grad()
    def first_token_probs(self, inputs: dict[str, torch.Tensor], first: list[int],
                          second: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The probabilities of two answers' first tokens (each summed over its spellings)."""
        logits = self.model(**inputs).logits[:, -1].float()
        p = torch.softmax(logits, dim=-1)
        return p[:, first].sum(-1).cpu().numpy(), p[:, second].sum(-1).cpu().numpy()

    @torch.no_grad()
    def answer_probs(self, images: np.ndarray, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(p(yes), p(no)) of the first answer token, each summed over its spellings."""
        if self.backend == "vllm":
            return self.vllm.answer_probs(images, prompts)
        return self.first_token_probs(self.inputs(images, prompts), self.yes, self.no)

    def score(self, images, prompts, metadata):
        ys, ns = [], []
        for s in range(0, len(images), self.batch_size):
            y, n = self.answer_probs(images[s:s + self.batch_size], list(prompts[s:s + self.batch_size]))
            ys.append(y)
            ns.append(n)
        y, n = np.concatenate(ys), np.concatenate(ns)
        return {self.name: (y / np.maximum(y + n, 1e-30)).astype(np.float32), f"{self.name}.p_yes": y.astype(np.float32),
                f"{self.name}.p_answer": (y + n).astype(np.float32)}
