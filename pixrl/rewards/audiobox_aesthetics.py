"""Audiobox Aesthetics: how good a clip's soundtrack sounds, by Meta's audio aesthetics predictor
(Tjandra et al. 2025, arXiv 2502.05139) — a WavLM Base+ encoder whose 13 hidden states are mixed
by a learned softmax per axis, mean-pooled over the valid frames, L2-normalised and read by a
linear head, on four axes: production quality (PQ), production complexity (PC), content enjoyment
(CE), content usefulness (CU), each on the 1–10 scale of its annotations (the head's output
un-normalised by the checkpoint's `target_transform`). The audio-quality reward beside CLAP's
text–audio alignment; a soundtrack reward (`takes = "soundtrack"`).

As the package's `AesPredictor` scores a file: the soundtrack averaged to mono and resampled to
16 kHz (here polyphase, scipy; the package uses torchaudio's sinc resampler), cut into 10 s
windows at a 10 s hop, each zero-padded to 10 s with its padding masked (a frame is padding when
all its samples are), and the clip's score the windows' mean weighted by their unpadded share.

The checkpoint is the released one (`path`: facebook/audiobox-aesthetics saved to disk —
config.json and model.safetensors), its encoder read into transformers' WavLMModel
(rewards/wavlm_layout.py). The main value is the mean of `axes` (default PQ); every axis is stored
as `audiobox_aesthetics.<axis>` (lower case).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..artifacts.media import read_wav
from .base import Reward, ScoringError, register_reward
from .clap import to_mono_at
from .wavlm_layout import AXES

RATE, WINDOW = 16_000, 10 * 16_000


def check_aesthetics_dir(path: str) -> dict:
    """The checkpoint's config (refused in preflight when `path` is not the released layout)."""
    p = Path(path) if path else None
    if p is None or not (p / "config.json").is_file() or not (p / "model.safetensors").is_file():
        raise ValueError(f"reward audiobox_aesthetics: {path!r} is not an Audiobox Aesthetics checkpoint (config.json "
                         "and model.safetensors); set reward.options.audiobox_aesthetics.path to "
                         "facebook/audiobox-aesthetics saved to disk")
    cfg = json.loads((p / "config.json").read_text())
    missing = [a for a in AXES if a not in (cfg.get("target_transform") or {})]
    if missing or not cfg.get("use_weighted_layer_sum", True) or cfg.get("nth_layer", 13) != 13:
        raise ValueError(f"reward audiobox_aesthetics: {path}/config.json is not the released layout (a target "
                         f"transform for each of {AXES}, the weighted sum of 13 layers); it has {sorted(cfg)}")
    return cfg


def head(cfg: dict, width: int) -> torch.nn.Sequential:
    """One axis' MLP in the released order: (Linear, [LayerNorm], GELU, [Dropout]) × (n − 1), Linear."""
    from torch import nn

    parts: list[nn.Module] = []
    for _ in range(int(cfg.get("proj_num_layer", 1)) - 1):
        parts += [nn.Linear(width, width), *([nn.LayerNorm(width)] if cfg.get("proj_ln") else []), nn.GELU(),
                  *([nn.Dropout(cfg["proj_dropout"])] if cfg.get("proj_dropout") else [])]
    return nn.Sequential(*parts, nn.Linear(width, int(cfg.get("output_dim", 1))))


def windows(wave: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mono 16 kHz samples → (10 s windows [N, WINDOW], their sample masks, unpadded shares)."""
    starts = range(0, max(len(wave), 1), WINDOW)
    out, masks, shares = np.zeros((len(starts), WINDOW)), np.zeros((len(starts), WINDOW), bool), []
    for i, s in enumerate(starts):
        part = wave[s:s + WINDOW]
        out[i, :len(part)], masks[i, :len(part)] = part, True
        shares.append(len(part) / WINDOW)
    return out, masks, np.asarray(shares)


def encoder_states(encoder, hidden: torch.Tensor, valid: torch.Tensor) -> list[torch.Tensor]:
    """transformers' WavLM encoder run layer by layer (its own modules, its order): the input to
    the first layer — padding zeroed, positional conv added, layer-normed — then each layer's
    output, 13 for WavLM Base+ (the original's `layer_results`)."""
    h = hidden.masked_fill(~valid.unsqueeze(-1), 0.0)
    h = encoder.layer_norm(h + encoder.pos_conv_embed(h))
    states, bias = [h], None
    for i, layer in enumerate(encoder.layers):
        h, bias = layer(h, attention_mask=valid, position_bias=bias, index=i)
        states.append(h)
    return states


@register_reward("audiobox_aesthetics")
class AudioboxAesthetics(Reward):
    value_range = (1.0, 10.0)
    takes = "soundtrack"
    components = tuple(a.lower() for a in AXES)

    def __init__(self, path: str = "", axes: list[str] | tuple[str, ...] = ("PQ",), batch_size: int = 8,
                 dtype: str = "float32"):
        self.config = check_aesthetics_dir(path)
        axes = [str(a).upper() for a in axes]
        if not axes or any(a not in AXES for a in axes):
            raise ValueError(f"reward audiobox_aesthetics: axes={axes}; choose from {list(AXES)}")
        self.path, self.axes, self.batch_size, self.dtype = path, axes, batch_size, dtype
        self.wavlm = self.heads = self.layer_weights = None

    def setup(self, device: str = "cpu") -> None:
        from safetensors.torch import load_file
        from transformers import WavLMModel

        from .wavlm_layout import split_state, wavlm_base_plus_config

        super().setup(device)
        wavlm_state, heads, layer_weights = split_state(load_file(str(Path(self.path) / "model.safetensors")))
        dtype = getattr(torch, self.dtype)
        try:
            self.wavlm = WavLMModel(wavlm_base_plus_config())
            self.wavlm.load_state_dict(wavlm_state, strict=True)
            self.heads = {}
            for axis in AXES:
                self.heads[axis] = head(self.config, self.wavlm.config.hidden_size)
                self.heads[axis].load_state_dict(heads[axis], strict=True)
        except (RuntimeError, KeyError) as exc:
            raise ScoringError(f"reward 'audiobox_aesthetics': {self.path}/model.safetensors does not fit the released "
                               f"layout: {exc}") from exc
        self.wavlm = self.wavlm.to(device, dtype).eval().requires_grad_(False)
        self.heads = {a: h.to(device).eval().requires_grad_(False) for a, h in self.heads.items()}
        self.layer_weights = {a: torch.softmax(layer_weights[a].float(), -1).to(device) for a in AXES}

    def score(self, images, prompts, metadata):
        """Every clip's windows in batches of `batch_size` windows (across clips), then each clip's
        axes as its windows' mean weighted by their unpadded share."""
        parts = [windows(to_mono_at(*read_wav(m["soundtrack"]), RATE)) for m in metadata]
        wins = np.concatenate([p[0] for p in parts])
        masks = np.concatenate([p[1] for p in parts])
        owner = np.concatenate([np.full(len(p[0]), i) for i, p in enumerate(parts)])
        shares = np.concatenate([p[2] for p in parts])
        preds = {a: [] for a in AXES}
        for s in range(0, len(wins), self.batch_size):
            for a, v in self.predict(wins[s:s + self.batch_size], masks[s:s + self.batch_size]).items():
                preds[a].append(v)
        out = {}
        for a in AXES:
            v = np.concatenate(preds[a]) * shares
            per_clip = np.bincount(owner, weights=v, minlength=len(parts)) / np.bincount(owner, weights=shares,
                                                                                           minlength=len(parts))
            out[f"{self.name}.{a.lower()}"] = per_clip.astype(np.float32)
        out[self.name] = np.mean([out[f"{self.name}.{a.lower()}"] for a in self.axes], axis=0).astype(np.float32)
        return out

    @torch.no_grad()
    def predict(self, wins: np.ndarray, masks: np.ndarray) -> dict[str, np.ndarray]:
        """Each window's four axes on the 1–10 scale."""
        wavlm = self.wavlm
        wav = torch.as_tensor(wins, dtype=wavlm.dtype, device=self.device)
        feats = wavlm.feature_extractor(wav).transpose(1, 2)  # [B, T, 512]
        hidden, _ = wavlm.feature_projection(feats)
        frames = feats.shape[1]
        pad = torch.as_tensor(~masks, device=self.device)[:, :frames * (WINDOW // frames)]  # the original's cut
        valid = ~pad.reshape(len(wins), frames, -1).all(-1)  # a frame is padding when all its samples are
        stacked = torch.stack([h.float() for h in encoder_states(wavlm.encoder, hidden, valid)], dim=-1)  # [B, T, C, 13]
        keep = valid.unsqueeze(-1).float()
        out = {}
        for a in AXES:
            embed = torch.einsum("btcl,l->btc", stacked, self.layer_weights[a])
            embed = (embed * keep).sum(1) / keep.sum(1).clamp(min=1)
            pred = self.heads[a](torch.nn.functional.normalize(embed, dim=-1)).squeeze(-1)
            t = self.config["target_transform"][a]
            out[a] = (pred * t["std"] + t["mean"]).cpu().numpy()
        return out
