"""Flow-GRPO's OCR reward (visual text rendering; SD3.5-M 0.59 → 0.92 in the paper): read the
image with an OCR engine and reward 1 − d/|t|, where t is the target text and d the Levenshtein
distance to the recognised text, both lowercased with spaces removed; d is 0 when t appears
inside the recognised text, and capped at |t| (flow_grpo/ocr.py). The target is the prompt
metadata's "text", else the prompt's first quoted span ("…" or “…”).

The engine is RapidOCR 3.x on ONNX Runtime (PP-OCRv6-small detection and recognition, shipped
inside the wheel: nothing is downloaded) — `pip install 'pixrl[ocr]'`. flow_grpo's PaddleOCR
fetches its models at run time. Lines below `min_confidence` are dropped, as PaddleOCR's
drop_score 0.5 does. Unlike flow_grpo, an engine failure is a ScoringError, not a silent 0.
"""

from __future__ import annotations

import logging
import re

import numpy as np

from .base import Reward, ScoringError, register_reward

_QUOTED = re.compile(r'"([^"]+)"|“([^”]+)”')


def target_text(prompt: str, meta: dict) -> str | None:
    """The text an image should show: metadata "text", else the prompt's first quoted span."""
    if meta.get("text"):
        return str(meta["text"])
    m = _QUOTED.search(prompt)
    return next(g for g in m.groups() if g) if m else None


def ocr_reward(recognised: str, target: str) -> float:
    """1 − min(d, |t|)/|t| on lowercased, space-free strings; d = 0 when t occurs in the text."""
    from rapidfuzz.distance import Levenshtein

    seen, want = recognised.replace(" ", "").lower(), target.replace(" ", "").lower()
    if not want:
        raise ValueError("the target text is empty")
    d = 0 if want in seen else min(Levenshtein.distance(seen, want), len(want))
    return 1.0 - d / len(want)


@register_reward("ocr")
class OcrReward(Reward):
    """Text-rendering accuracy in [0, 1]; diagnostics: `ocr.confidence` (mean line confidence of
    what was read, 0 when nothing was)."""

    value_range = (0.0, 1.0)
    requires = ("rapidocr", "onnxruntime", "rapidfuzz")
    extra = "ocr"

    def __init__(self, min_confidence: float = 0.5, threads: int = 0):
        self.min_confidence, self.threads = min_confidence, threads
        self.engine = None

    def setup(self, device: str = "cpu") -> None:
        super().setup(device)
        rapid_ocr = self.optional_import("rapidocr", "RapidOCR")
        params = {"Global.log_level": "error", "Global.text_score": self.min_confidence}
        if self.threads:
            params["EngineConfig.onnxruntime.intra_op_num_threads"] = self.threads
        self.engine = rapid_ocr(params=params)
        logging.getLogger("RapidOCR").setLevel(logging.ERROR)

    def read(self, image: np.ndarray) -> tuple[str, float]:
        """(recognised text, its lines joined in reading order; mean confidence)."""
        try:
            out = self.engine(np.ascontiguousarray(image[..., ::-1]))  # RapidOCR takes arrays as BGR
        except Exception as exc:  # the engine raises many types; name the scorer and the cause
            raise ScoringError(f"the ocr reward's engine failed on a {image.shape} image: {exc}") from exc
        if not out.txts:
            return "", 0.0
        return "".join(out.txts), float(np.mean(out.scores))

    @staticmethod
    def _targets(prompts: list[str], metadata: list[dict]) -> list[str]:
        targets = [target_text(p, m) for p, m in zip(prompts, metadata)]
        missing = [p for p, t in zip(prompts, targets) if not t]
        if missing:
            raise ScoringError(f"the ocr reward needs the text each image should show; prompt {missing[0][:60]!r} "
                               f"quotes none — put it in quotes (“…” or \"…\") or in the prompt metadata 'text'")
        return targets

    def check_prompts(self, prompts, metadata) -> None:
        try:
            self._targets(prompts, metadata)
        except ScoringError as exc:
            raise ValueError(str(exc)) from None

    def score(self, images, prompts, metadata):
        targets = self._targets(prompts, metadata)
        values, conf = [], []
        for image, target in zip(images, targets):
            text, c = self.read(image)
            values.append(ocr_reward(text, target))
            conf.append(c)
        return {self.name: np.array(values, np.float32), f"{self.name}.confidence": np.array(conf, np.float32)}
