"""The scoring contract every reward implements, and the registry that names them.

A reward scores uint8 images [B, H, W, 3] with their prompts and prompt metadata and returns
float32 arrays of length B: its main value under its own name, optionally diagnostics under
"<name>.<key>". It declares its range, direction and device needs. Nothing is ever zeroed:
NaN, a missing key or a wrong length is a ScoringError naming the sample and the scorer.

Video goes through the same contract: an image reward (`takes = "image"`) scores every frame of
clips [B, F, H, W, 3] and the clip's score is the mean over its frames (RewardSet does this); a
clip reward (`takes = "clip"`, e.g. temporal consistency) receives the clips whole. Sound too: a
soundtrack reward (`takes = "soundtrack"`, e.g. CLAP's text–audio score) receives the clips whole
with each sample's soundtrack in its metadata (`soundtrack`: the 16-bit WAV bytes decode stores;
`artifacts.media.read_wav`), and is refused before a run on a family whose clips are silent.

A group reward (`groupwise = True`, e.g. Pref-GRPO's pairwise win rate) scores each sample against
the others of its group, and receives `groups=` (one key per sample, `group_keys`); the stages
hand it whole groups.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod

import numpy as np

from ..config.registry import Registry
from ..errors import ExpectedError


class ScoringError(ExpectedError, RuntimeError):
    """A scorer produced no usable score for some sample."""


class Reward(ABC):
    """Built once per engine (cheap: options only); `setup(device)` loads weights once, lazily,
    before the first score — so a model-based scorer loads once per process, not per iteration,
    and a run whose score stage is already committed loads nothing."""

    name: str = ""
    value_range: tuple[float, float] = (-np.inf, np.inf)
    higher_is_better: bool = True
    device: str = "cpu"
    ready: bool = False
    # "image": frame-wise on clips (mean over frames); "clip": whole clips only; "soundtrack": whole
    # clips with their soundtracks (metadata "soundtrack"); "media": whatever the family makes,
    # whole (a reward served elsewhere, whose own RewardSet splits clips per reward)
    takes: str = "image"
    groupwise: bool = False  # scores samples against their group's others: score(..., groups=keys)
    #: the parts it also stores as `<name>.<part>` that reward.advantage_weights may weigh apart
    components: tuple[str, ...] = ()
    #: modules the scorer imports when it is set up, and the pip extra that installs them
    requires: tuple[str, ...] = ()
    extra: str = ""

    def check_prompts(self, prompts: list[str], metadata: list[dict]) -> None:
        """Refuse, before a run starts, prompts this reward cannot score (ValueError naming one)."""

    def optional_import(self, module: str, attr: str):
        """`module.attr` from one of the packages the scorer `requires`, or a ScoringError naming
        the pip extra that installs them."""
        import importlib

        try:
            return getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            raise ScoringError(f"the {self.name} reward needs {', '.join(self.requires)} ({exc.name} is missing); "
                               f"install them with `pip install 'pixrl[{self.extra}]'`") from None

    def connect(self) -> None:
        """Learn, before a run starts, what a reward scored elsewhere does (`scorers`, `components`,
        `groupwise`); ValueError naming the server and the fix when it cannot. Nothing to learn for a
        reward scored here."""

    def scorers(self) -> dict[str, str]:
        """{name: takes} of what scores under this reward: itself (a served set: each served
        reward, as `<name>.<served>`, once `connect` has learnt them)."""
        return {self.name: self.takes}

    def setup(self, device: str = "cpu") -> None:
        """Load whatever the scorer needs onto `device` (rule-based scorers need nothing)."""
        self.device = device

    def ensure_setup(self, device: str) -> None:
        if not self.ready:
            self.setup(device)
            self.ready = True

    @abstractmethod
    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict]) -> dict[str, np.ndarray]:
        ...


ROLLOUT_ID = re.compile(r"^(\d{5}-\d{3})-\d{2}$")  # <iteration>-<group slot>-<sample in group>


def group_keys(prompts: list[str], sample_ids: list[str]) -> list[str]:
    """Each scored sample's group: the rollout's (sample ids `<iteration>-<slot>-<g>` share the
    iteration and slot), or, for ids of another form (`pixrl score`, a reward-service request
    without groups), the samples with the same prompt."""
    keys = [ROLLOUT_ID.match(s) for s in sample_ids]
    if all(keys):
        return [k.group(1) for k in keys]
    return [f"prompt:{p}" for p in prompts]


def _builtin() -> None:
    from . import (aesthetic, audiobox_aesthetics, brisque, clap, clip_score, diversity, editreward, hpsv2, hpsv3, image_similarity,  # noqa: F401
                   imagereward, jpeg, nsfw, ocr, pairwise_judge, people, pickscore, remote, shapes, temporal,
                   unified_reward, videoalign, vlm_judge)


REWARDS: Registry[type[Reward]] = Registry("reward", "rewards", _builtin)
register_reward = REWARDS.register
registered_rewards = REWARDS.names


def build_reward(name: str, **options) -> Reward:
    cls = REWARDS.get(name)
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for reward {name!r}: {exc}") from None
