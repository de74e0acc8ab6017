"""What kind of policy a model family is: generation regime × policy step × action space.

Samplers, losses and stores dispatch on these, never on family names, so a new family only
declares where it sits.
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict


class Regime(str, Enum):
    full_sequence = "full_sequence"  # the whole image/video is denoised jointly (SD3, FLUX, Wan)
    token_autoregressive = "token_autoregressive"  # one token at a time (Janus-Pro)
    chunk_autoregressive = "chunk_autoregressive"  # chunks of frames/tokens, each denoised


class PolicyStep(str, Enum):
    denoise = "denoise"  # an action is one denoising transition x_k -> x_{k+1}
    token = "token"  # an action is one sampled token


class Action(str, Enum):
    continuous = "continuous"  # Gaussian transition: log-prob from (mean, std)
    categorical = "categorical"  # softmax over a vocabulary


class PolicySemantics(BaseModel):
    """Declared on every family; stored on every trajectory row."""

    model_config = ConfigDict(frozen=True)
    regime: Regime
    step: PolicyStep
    action: Action
