"""CLAP score: how well a clip's soundtrack matches its text — the cosine between CLAP's
(Contrastive Language-Audio Pretraining, Wu et al., arXiv 2211.06687) audio embedding of the
soundtrack and its text embedding of the prompt, the text–audio reward VeRL-Omni trains LTX-2's
audio with and the usual text-to-audio metric. A soundtrack reward (`takes = "soundtrack"`): it
reads each sample's WAV from the metadata (decode stores it for a family whose clips have sound).

The model is a transformers `ClapModel` with its `ClapProcessor` in a local directory
(reward.options.clap_score.path: e.g. laion/clap-htsat-unfused or laion/larger_clap_general saved
to disk); nothing is downloaded. The soundtrack goes in as CLAP was trained: its channels averaged
to mono and resampled (polyphase, scipy) to the feature extractor's rate (48 kHz), shorter clips
repeated and padded to its window. The text is the prompt, or with `text_key` a field of the
prompt's metadata (a dataset whose sound has its own caption).

Deterministic where the feature extractor is not: it marks one sample of every batch as "longer"
at random (the fused models' switch) — here a soundtrack is "longer" only if it is longer than the
window — and a soundtrack longer than the window is cropped at a random place; those crops are
drawn from a fixed seed, so a score is a function of the soundtrack and the text alone.
"""

from __future__ import annotations

from math import gcd
from pathlib import Path

import numpy as np
import torch

from ..artifacts.media import read_wav
from .base import Reward, ScoringError, register_reward


def check_clap_dir(path: str) -> None:
    """Refuse (in preflight) a path that is not a CLAP checkpoint with its processor."""
    p = Path(path) if path else None
    if p is None or not (p / "config.json").is_file():
        raise ValueError(f"reward clap_score: {path!r} is not a CLAP checkpoint in the transformers layout (no "
                         "config.json); set reward.options.clap_score.path to a local ClapModel directory (e.g. "
                         "laion/clap-htsat-unfused saved with save_pretrained)")
    if not (p / "preprocessor_config.json").is_file() and not (p / "processor_config.json").is_file():
        raise ValueError(f"reward clap_score: {path!r} has no CLAP feature extractor (preprocessor_config.json); "
                         "save the model's ClapProcessor beside it (ClapProcessor.save_pretrained)")


def to_mono_at(wave: np.ndarray, rate: int, target: int) -> np.ndarray:
    """float waveform [channels, samples] at `rate` → mono float64 [samples'] at `target`."""
    from scipy.signal import resample_poly

    mono = np.asarray(wave, np.float64).mean(axis=0)
    if rate == target:
        return mono
    g = gcd(int(rate), int(target))
    return resample_poly(mono, target // g, rate // g)


@register_reward("clap_score")
class ClapScore(Reward):
    value_range = (-1.0, 1.0)
    takes = "soundtrack"

    def __init__(self, path: str = "", batch_size: int = 16, text_key: str = "", dtype: str = "float32"):
        check_clap_dir(path)
        self.path, self.batch_size, self.text_key, self.dtype = path, batch_size, text_key, dtype
        self.model = self.processor = None

    def check_prompts(self, prompts: list[str], metadata: list[dict]) -> None:
        if self.text_key:
            lacking = [p for p, m in zip(prompts, metadata) if not isinstance(m.get(self.text_key), str)]
            if lacking:
                raise ValueError(f"reward clap_score: text_key={self.text_key!r}, and {len(lacking)} prompt(s) have no "
                                 f"such text in their metadata (e.g. {lacking[0]!r}); add it or unset text_key")

    def setup(self, device: str = "cpu") -> None:
        from transformers import ClapModel, ClapProcessor

        super().setup(device)
        try:
            self.model = ClapModel.from_pretrained(self.path, dtype=getattr(torch, self.dtype)).to(device).eval()
            self.processor = ClapProcessor.from_pretrained(self.path)
        except Exception as exc:  # transformers raises many types; name the path and the cause
            raise ScoringError(f"reward 'clap_score': could not load CLAP from {self.path!r}: {exc}") from exc
        self.model.requires_grad_(False)

    def score(self, images, prompts, metadata):
        texts = [m[self.text_key] for m in metadata] if self.text_key else list(prompts)
        sounds = [read_wav(m["soundtrack"]) for m in metadata]
        out = [self.cosines(sounds[s:s + self.batch_size], texts[s:s + self.batch_size])
               for s in range(0, len(texts), self.batch_size)]
        return {self.name: np.concatenate(out).astype(np.float32)}

    @torch.no_grad()
    def cosines(self, sounds: list[tuple[np.ndarray, int]], texts: list[str]) -> np.ndarray:
        """cos(audio embedding, text embedding) per (soundtrack, text)."""
        fe = self.processor.feature_extractor
        waves = [to_mono_at(w, rate, fe.sampling_rate) for w, rate in sounds]
        state = np.random.get_state()
        try:  # the extractor's crops of an over-long soundtrack, from a fixed seed
            np.random.seed(0)
            feats = fe(waves, sampling_rate=fe.sampling_rate, return_tensors="pt")
        finally:
            np.random.set_state(state)
        longer = torch.tensor([[len(w) > fe.nb_max_samples] for w in waves])
        audio = self.model.get_audio_features(input_features=feats["input_features"].to(self.device, self.model.dtype),
                                              is_longer=longer.to(self.device))
        tok = self.processor.tokenizer(texts, padding=True, truncation=True, return_tensors="pt").to(self.device)
        text = self.model.get_text_features(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])
        a = torch.nn.functional.normalize(audio.pooler_output.float(), dim=-1)
        t = torch.nn.functional.normalize(text.pooler_output.float(), dim=-1)
        return (a * t).sum(-1).cpu().numpy()
