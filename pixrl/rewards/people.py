"""Rewards for prompts that ask for people, from the face and pose models shipped inside the
mediapipe 0.10.21 wheel (BlazeFace short/full range, BlazePose full). mediapipe pins numpy < 2 and
protobuf < 5, so it runs in its own environment (`pixrl setup-mediapipe`) behind a worker process
(rewards/mediapipe_client.py); nothing is downloaded.

- `face`: faces detected with score ≥ `min_confidence`. When the prompt says how many people it
  wants (metadata `faces` or `people`, else number words before person nouns: "two women",
  "a man and a woman" → 2) the reward is 1 − min(|found − n|, n)/n (n = 0: 1 if none is found);
  otherwise it is the best face score (is there a face at all). `face.count`, `face.max_score`.
- `pose`: the fraction of BlazePose's 33 landmarks visible (visibility ≥ `min_visibility`) on the
  person it finds (a single-person model), 0 with nobody: rewards a whole, unoccluded body.
  `pose.detected`, `pose.mean_visibility`.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .base import Reward, register_reward
from .mediapipe_client import SETUP_HINT, MediapipeWorker, default_python

_NUMBERS = {"a": 1, "an": 1, "one": 1, "single": 1, "lone": 1, "two": 2, "pair": 2, "couple": 2, "three": 3,
            "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10, "no": 0}
_PERSON = r"(?:person|persons|people|man|men|woman|women|boy|boys|girl|girls|child|children|kid|kids|face|faces)"
_COUNTED = re.compile(rf"\b({'|'.join(_NUMBERS)}|\d+)\s+(?:of\s+)?(?:(?!of\b)[a-z-]+\s+){{0,2}}?{_PERSON}\b", re.I)


def expected_people(prompt: str, metadata: dict) -> int | None:
    """How many people the prompt asks for, or None when it does not say."""
    for key in ("faces", "people"):
        if key in metadata:
            return int(metadata[key])
    found = [m.group(1).lower() for m in _COUNTED.finditer(prompt)]
    if not found:
        return None
    return sum(int(w) if w.isdigit() else _NUMBERS[w] for w in found)


def _check_python(python: str, name: str) -> str:
    python = python or default_python()
    if not Path(python).is_file():
        raise ValueError(f"reward {name}: no mediapipe environment at {python!r}; {SETUP_HINT.replace('NAME', name)}")
    return python


class _MediapipeReward(Reward):
    """A reward computed from detections of mediapipe's worker process (one per interpreter,
    started at setup), sent `batch` images at a time."""

    def __init__(self, python: str, name: str, batch: int):
        self.python, self.batch = _check_python(python, name), batch

    def setup(self, device: str = "cpu") -> None:
        super().setup(device)
        self.worker = MediapipeWorker.of(self.python)
        self.worker.start()

    def detect(self, task: str, images, **options) -> list:
        found = []
        for s in range(0, len(images), self.batch):
            found += self.worker.call(task, images[s:s + self.batch], **options)
        return found


@register_reward("face")
class FaceCount(_MediapipeReward):
    value_range = (0.0, 1.0)

    def __init__(self, python: str = "", min_confidence: float = 0.5, model_selection: int = 0, batch: int = 16):
        if model_selection not in (0, 1):
            raise ValueError(f"reward face: model_selection must be 0 (short range) or 1 (full range), "
                             f"not {model_selection}")
        super().__init__(python, "face", batch)
        self.min_confidence, self.model_selection = min_confidence, model_selection

    def score(self, images, prompts, metadata):
        found = self.detect("face", images, min_confidence=self.min_confidence, model_selection=self.model_selection)
        count = np.array([len(f) for f in found], np.float32)
        best = np.array([max((d[0] for d in f), default=0.0) for f in found], np.float32)
        value = best.copy()
        for i, (p, m) in enumerate(zip(prompts, metadata)):
            n = expected_people(p, m)
            if n is not None:
                value[i] = (1.0 - min(abs(count[i] - n), n) / n) if n else float(count[i] == 0)
        return {self.name: value, f"{self.name}.count": count, f"{self.name}.max_score": best}


@register_reward("pose")
class PoseVisibility(_MediapipeReward):
    value_range = (0.0, 1.0)

    def __init__(self, python: str = "", min_confidence: float = 0.5, min_visibility: float = 0.5, batch: int = 16):
        super().__init__(python, "pose", batch)
        self.min_confidence, self.min_visibility = min_confidence, min_visibility

    def score(self, images, prompts, metadata):
        found = self.detect("pose", images, min_confidence=self.min_confidence)
        vis = [np.array(v, np.float32) if v is not None else None for v in found]
        frac = np.array([0.0 if v is None else float((v >= self.min_visibility).mean()) for v in vis], np.float32)
        return {self.name: frac, f"{self.name}.detected": np.array([v is not None for v in vis], np.float32),
                f"{self.name}.mean_visibility": np.array([0.0 if v is None else float(v.mean()) for v in vis],
                                                         np.float32)}
