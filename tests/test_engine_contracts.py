"""The seams of the stage layer: the completion table, the prompt-embedding cache, the Family
protocol's device rule, the batch-level algorithm contract (its terms replay the rollout
exactly) and rewards built once with a lazy setup."""

import numpy as np
import pytest
import torch

from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.replay import ReplayPolicy
from pixrl.algorithms.sampling import SamplerRecipe, generators, sample
from pixrl.artifacts.batch import RolloutBatch
from pixrl.config.schema import STAGES, AlgorithmConfig
from pixrl.engines.prompt_cache import PromptCache
from pixrl.models.base import Conditioning
from pixrl.models.sd3 import SD3Family
from pixrl.rewards.base import Reward, register_reward
from pixrl.rewards.compose import RewardSet
from pixrl.stages.completion import FILLED_BY, MARKS


@pytest.fixture(scope="module")
def family(tiny_checkpoint):
    return SD3Family.load(tiny_checkpoint, max_sequence_length=0)


def test_one_completion_table_covers_every_stage():
    assert tuple(MARKS) == STAGES
    assert FILLED_BY == {"decode": ("image",), "score": ("rewards", "reward"), "replay": ("advantage",)}
    assert {MARKS[s].kind for s in ("update", "publish")} == {"checkpoint", "version"}


def test_prompt_cache_hits_the_same_prompt_set_and_returns_identical_embeddings(family):
    cache = PromptCache(family, capacity=2)
    first, pos = cache.encode(["a red circle", "a blue square", "a red circle"])
    again, pos2 = cache.encode(["a blue square", "a red circle"])  # same set, other order
    assert again is first and pos == pos2 and cache.hits == 1 and cache.misses == 1
    assert isinstance(first, Conditioning)
    direct = family.encode_prompts(sorted({"a red circle", "a blue square"}))
    assert torch.equal(first.prompt_embeds, direct.prompt_embeds)
    cache.encode(["a green triangle"])
    cache.encode(["two blue squares"])
    cache.encode(["a red circle", "a blue square"])  # evicted by the capacity bound: encoded again
    assert cache.misses == 4


def test_family_keeps_schedules_and_noise_on_its_device(family):
    sigmas, timesteps = family.schedule(4)
    assert sigmas.device == family.device and timesteps.device == family.device
    gens = generators([1, 2], family.device)
    assert all(g.device == family.device for g in gens)
    assert "sd3" in family.identity() and family.describe()["resolution"] == list(family.latent_shape())


def test_batch_level_loss_replays_the_rollout_with_ratio_exactly_one(family):
    """The algorithm's own loop over stored steps, through the shared replay step, on a batch
    built from a real rollout: before any update every term's ratio is exactly 1."""
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_steps=(0, 1), train_steps=(0, 1))
    prompts = ["a red circle", "a blue square"] * 2
    cond_all, pos = PromptCache(family).encode(prompts)
    cond = cond_all.select([pos[p] for p in prompts])
    traj = sample(family, cond, None, generators([0, 1, 2, 3], family.device), recipe)
    batch = RolloutBatch({"latents": traj.latents.numpy(), "next_latents": traj.next_latents.numpy(),
                          "log_probs": traj.log_probs.numpy(), "advantage": np.array([1, -1, 0.5, -0.5], np.float32),
                          "stored_steps": np.tile(np.array([0, 1], np.int32), (4, 1))})
    algo = build_algorithm(AlgorithmConfig(clip_range=1e-4))
    policy = ReplayPolicy(family, None, cond, None, traj.sigmas, traj.timesteps, recipe, family.device)
    terms = list(algo.losses(batch, policy))
    assert len(terms) == algo.terms(batch) == 2
    for loss, m in terms:
        assert float(m["ratio_max"]) == 1.0 and float(m["ratio_min"]) == 1.0
        assert loss.requires_grad
    assert algo.trains_on(np.array([0.0, 1.0])).tolist() == [False, True]


@register_reward("counting_setup_probe")
class _SetupProbe(Reward):
    """A reward that records its setup calls (what a model-based scorer's weight loading is)."""

    setups = 0

    def setup(self, device="cpu"):
        super().setup(device)
        type(self).setups += 1

    def score(self, images, prompts, metadata):
        return {self.name: images.reshape(len(images), -1).mean(1).astype(np.float32) / 255}


def test_rewards_are_built_once_and_set_up_lazily_once():
    rs = RewardSet({"counting_setup_probe": 1.0}, device="cpu")
    assert _SetupProbe.setups == 0  # building loads nothing
    imgs = np.zeros((2, 4, 4, 3), np.uint8)
    for _ in range(3):
        rs.score(imgs, ["a", "b"], [{}, {}], ["s0", "s1"])
    assert _SetupProbe.setups == 1 and rs.rewards["counting_setup_probe"].device == "cpu"
