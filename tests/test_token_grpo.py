"""Token-level GRPO against the formulas of algorithms.md §11: the logit transform (CFG on logits,
temperature, top-k), per-token PPO-clip with clip-higher and its gradients, the k3 KL, the
entropy under top-k, group advantages with the unbiased std and DAPO's group filter."""

import math

import numpy as np
import pytest
import torch

from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.token_grpo import k3_kl, token_group_advantages, token_ppo_loss
from pixrl.algorithms.token_sampling import TokenRecipe, log_probs_and_entropy, transform_logits
from pixrl.config.loader import ConfigError
from pixrl.config.schema import AlgorithmConfig, SamplingConfig


def test_logit_transform_is_guidance_then_temperature_then_top_k():
    cond = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    uncond = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    z = transform_logits(torch.cat([cond, uncond]), TokenRecipe(3.0, 0.5, 2), batch=1)
    guided = uncond + 3.0 * (cond - uncond)  # [4, 1, -2, -5]
    want = (guided / 0.5).masked_fill(torch.tensor([[False, False, True, True]]), float("-inf"))
    assert torch.equal(z, want)
    assert torch.equal(transform_logits(cond, TokenRecipe(), batch=1), cond)  # no guidance: no uncond rows


def test_log_prob_and_entropy_with_a_truncated_support():
    z = torch.tensor([[[math.log(3.0), 0.0, float("-inf")]]])  # p = (3/4, 1/4, 0)
    lp, ent = log_probs_and_entropy(z, torch.tensor([[1]]))
    assert torch.allclose(lp, torch.tensor([[math.log(0.25)]]))
    assert torch.allclose(ent, torch.tensor([[-(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]]))
    z.requires_grad_(True)
    _, ent = log_probs_and_entropy(z, torch.tensor([[0]]))
    ent.sum().backward()
    assert torch.isfinite(z.grad).all()  # the −∞ entry contributes no NaN


def test_ppo_clip_per_token_with_clip_higher():
    old = torch.zeros(2, 3)
    new = torch.log(torch.tensor([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]]))
    adv = torch.tensor([1.0, -2.0])
    loss, m = token_ppo_loss(new, old, adv, clip_low=0.2, clip_high=0.28)
    # A=+1: max(−ρ, −clip(ρ, 0.8, 1.28)) = −1, −1.28, −0.5;  A=−2: max(2ρ, 2·clip) = 2, 3, 1.6
    want = np.mean([-1.0, -1.28, -0.5, 2.0, 3.0, 1.6])
    assert float(loss) == pytest.approx(want, abs=1e-6)
    assert float(m["clipfrac"]) == pytest.approx(4 / 6) and float(m["ratio_max"]) == pytest.approx(1.5)


def test_gradient_is_minus_advantage_on_policy_and_zero_where_clipped():
    old = torch.zeros(1, 2)
    new = torch.zeros(1, 2, requires_grad=True)
    loss, _ = token_ppo_loss(new, old, torch.tensor([0.5]), 0.2, 0.2)
    loss.backward()
    assert torch.allclose(new.grad, torch.full((1, 2), -0.5 / 2))  # −A/(B·N)
    far = torch.log(torch.tensor([[2.0, 0.9]])).requires_grad_(True)
    loss, _ = token_ppo_loss(far, old, torch.tensor([1.0]), 0.2, 0.2)
    loss.backward()
    assert float(far.grad[0, 0]) == 0.0 and float(far.grad[0, 1]) == pytest.approx(-0.9 / 2)


def test_k3_kl_matches_its_formula():
    lp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -2.0, -0.1])
    d = ref - lp
    assert torch.allclose(k3_kl(lp, ref), torch.exp(d) - d - 1)
    assert float(k3_kl(lp, ref)[1]) == 0.0 and bool((k3_kl(lp, ref) >= 0).all())


def test_group_advantages_use_the_unbiased_std_and_drop_flat_groups():
    rewards = np.array([1.0, 2.0, 3.0, 0.5, 0.5, 0.5])
    groups = np.array([0, 0, 0, 1, 1, 1])
    adv = token_group_advantages(rewards, groups, eps=1e-4)
    assert np.allclose(adv.advantages[:3], np.array([-1.0, 0.0, 1.0]) / (1.0 + 1e-4))  # std(ddof=1) = 1
    assert np.all(adv.advantages[3:] == 0) and adv.zero_std_ratio == 0.5
    algo = build_algorithm(AlgorithmConfig(name="token_grpo"))
    assert algo.trains_on(adv.advantages).tolist() == [True, False, True, False, False, False]
    keep_all = build_algorithm(AlgorithmConfig(name="token_grpo", filter_groups=False))
    assert keep_all.trains_on(adv.advantages).all()


def test_settings_of_another_algorithm_are_refused_with_the_valid_keys():
    with pytest.raises(ConfigError, match="unknown key 'algorithm.noise_level' for algorithm 'token_grpo'.*clip_range"):
        build_algorithm(AlgorithmConfig(name="token_grpo", noise_level=0.7))


def test_adaptive_entropy_coefficient_steps_towards_the_target():
    """α = sinh ψ; the first Adam step moves ψ by lr·g/(|g| + eps), g = cosh(ψ)·(H − target):
    α rises while H is below the target, falls above it, and stays inside its bounds."""
    from pixrl.algorithms.entropy_control import AdaptiveEntropyCoefficient

    ctl = AdaptiveEntropyCoefficient(initial=0.0, target=7.0, lr=1e-3, min_coeff=-1e-2, max_coeff=1e-2)
    g = math.cosh(0.0) * (5.0 - 7.0)
    assert ctl.update(5.0) == pytest.approx(math.sinh(-1e-3 * g / (abs(g) + 1e-8)), rel=1e-9)
    assert ctl.alpha > 0
    down = AdaptiveEntropyCoefficient(initial=0.0, target=2.0, lr=1e-3, min_coeff=-1e-2, max_coeff=1e-2)
    assert down.update(5.0) < 0
    capped = AdaptiveEntropyCoefficient(initial=0.0, target=7.0, lr=0.5, min_coeff=-1e-2, max_coeff=1e-2)
    assert capped.update(1.0) == pytest.approx(1e-2)
    again = AdaptiveEntropyCoefficient(initial=0.0, target=7.0, lr=1e-3, min_coeff=-1e-2, max_coeff=1e-2)
    again.load_state_dict(ctl.state_dict())  # the state continues exactly (Adam moments included)
    assert again.update(6.0) == ctl.update(6.0)


def test_token_grpo_carries_its_adaptive_coefficient_through_its_state():
    algo = build_algorithm(AlgorithmConfig(name="token_grpo", entropy_target=7.0, entropy_coeff_lr=1e-3,
                                           entropy_coeff_min=-0.01, entropy_coeff_max=0.01))
    assert algo.entropy_coeff == 0.0
    first = algo.after_optimizer_step({"entropy": 4.0})["entropy_coeff"]
    state = algo.state()
    resumed = build_algorithm(AlgorithmConfig(name="token_grpo", entropy_target=7.0, entropy_coeff_lr=1e-3,
                                              entropy_coeff_min=-0.01, entropy_coeff_max=0.01))
    resumed.load_state(state)
    assert resumed.entropy_coeff == first > 0
    assert resumed.after_optimizer_step({"entropy": 4.0}) == algo.after_optimizer_step({"entropy": 4.0})
    resumed.load_state(None)  # base weights: the initial α again
    assert resumed.entropy_coeff == 0.0
    with pytest.raises(ConfigError, match="outside"):
        build_algorithm(AlgorithmConfig(name="token_grpo", entropy_target=7.0, entropy_coeff=0.5))


def test_ppo_clip_over_text_and_image_tokens_is_a_masked_token_mean():
    """T2I-R1's Σ mask·loss / Σ mask over [text ; image]: padded text positions count for nothing."""
    old = torch.zeros(2, 4)
    new = torch.log(torch.tensor([[1.0, 9.0, 1.5, 0.5], [1.0, 1.0, 1.5, 0.5]]))
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])  # row 0's second text position is padding
    loss, m = token_ppo_loss(new, old, torch.tensor([1.0, -2.0]), 0.2, 0.28, mask)
    want = np.mean([-1.0, -1.28, -0.5, 2.0, 2.0, 3.0, 1.6])
    assert float(loss) == pytest.approx(want, abs=1e-6)
    assert float(m["ratio_max"]) == pytest.approx(1.5)  # the masked 9.0 is not a sampled token
    assert float(m["clipfrac"]) == pytest.approx(4 / 7)


def test_text_and_image_entropy_coefficients_adapt_separately_and_resume():
    cfg = dict(name="token_grpo", entropy_target=7.0, text_entropy_target=2.0, entropy_coeff_lr=1e-3,
               entropy_coeff_min=-0.01, entropy_coeff_max=0.01)
    algo = build_algorithm(AlgorithmConfig(**cfg))
    out = algo.after_optimizer_step({"entropy": 4.0, "entropy_text": 3.0})
    assert out["entropy_coeff"] > 0 > out["text_entropy_coeff"]  # image below its target, text above
    resumed = build_algorithm(AlgorithmConfig(**cfg))
    resumed.load_state(algo.state())
    step = {"entropy": 8.0, "entropy_text": 1.0}
    assert resumed.after_optimizer_step(step) == algo.after_optimizer_step(step)
    image_only = build_algorithm(AlgorithmConfig(**{**cfg, "text_entropy_target": None}))
    image_only.after_optimizer_step({"entropy": 4.0})
    assert "psi" in image_only.state()  # an image-only state keeps the format earlier checkpoints saved


def test_a_ratio_to_the_current_policy_is_one_and_never_clipped(tiny_janus):
    """T2I-R1: ρ = exp(logp − logp.detach()) — on the tiny Janus, with stored log-probs far below
    the policy's (as a guided rollout's can be), PPO's ratio against them clips every token (no
    gradient) while the ratio to the current policy is exactly 1 and the gradient is A·∇logp."""
    from pixrl.algorithms.replay import TokenReplayPolicy
    from pixrl.algorithms.token_sampling import sample_tokens
    from pixrl.artifacts.batch import RolloutBatch
    from pixrl.models.janus import JanusProFamily

    fam = JanusProFamily.load(tiny_janus[0])
    recipe = TokenRecipe(5.0)
    cond = fam.encode_prompts(["a red circle"])
    traj = sample_tokens(fam, cond, [torch.Generator().manual_seed(1)], recipe)
    batch = RolloutBatch({"tokens": traj.tokens.numpy().astype(np.int32), "log_probs": (traj.log_probs - 5.0).numpy(),
                          "advantage": np.array([1.0], np.float32)})
    policy = TokenReplayPolicy(fam, None, cond, recipe, fam.device)
    fam.model.requires_grad_(True)
    try:
        for ratio_to, clipped in (("rollout", True), ("current", False)):
            algo = build_algorithm(AlgorithmConfig(name="token_grpo", ratio_to=ratio_to))
            fam.model.zero_grad(set_to_none=True)
            ((loss, m),) = list(algo.losses(batch, policy))
            loss.backward()
            grad = sum(float(p.grad.abs().sum()) for p in fam.model.parameters() if p.grad is not None)
            assert (grad == 0.0) == clipped  # ρ = e⁵ ≫ 1 + ε with A > 0: every token clipped
            if not clipped:
                assert float(m["ratio_max"]) == float(m["ratio_min"]) == 1.0
    finally:
        fam.model.requires_grad_(False)


def test_rollout_weights_truncate_or_mask_per_token_and_per_sequence():
    """ρ = π_old/μ from the stored policy log-probs and the text server's; padding never counts."""
    from pixrl.algorithms.rollout_correction import rollout_weights

    behavior = torch.zeros(2, 3)
    old = torch.log(torch.tensor([[3.0, 0.25, 1.5], [1.2, 1.0, 7.0]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # row 1's last position is padding
    w, kept, m = rollout_weights(old, behavior, mask, "token_truncate", 2.0)
    assert torch.allclose(w[0], torch.tensor([2.0, 0.25, 1.5])) and torch.allclose(w[1, :2], torch.tensor([1.2, 1.0]))
    assert kept.tolist() == mask.tolist() and float(m["rollout_is/corrected_frac"]) == pytest.approx(1 / 5)
    w, kept, m = rollout_weights(old, behavior, mask, "token_mask", 2.0)  # kept within [1/2, 2]
    assert kept.tolist() == [[0, 0, 1], [1, 1, 0]] and torch.allclose(w[0, 2], torch.tensor(1.5))
    assert float(m["rollout_is/corrected_frac"]) == pytest.approx(2 / 5)
    w, kept, _ = rollout_weights(old, behavior, mask, "sequence_truncate", 2.0)  # ρ_0 = 1.125, ρ_1 = 1.2
    assert torch.allclose(w[0], torch.full((3,), 1.125)) and torch.allclose(w[1, :2], torch.full((2,), 1.2))
    w, kept, _ = rollout_weights(old, behavior, mask, "sequence_mask", 1.15, low=0.9)  # ρ_1 = 1.2 > 1.15
    assert kept.tolist() == [[1, 1, 1], [0, 0, 0]] and torch.allclose(w[0], torch.full((3,), 1.125))


def test_weighted_ppo_loss_is_the_weighted_masked_token_mean():
    old, new = torch.zeros(1, 3), torch.log(torch.tensor([[1.1, 0.9, 1.0]]))
    weights, mask = torch.tensor([[2.0, 0.5, 1.0]]), torch.tensor([[1, 0, 1]])
    loss, _ = token_ppo_loss(new, old, torch.tensor([1.0]), 0.2, 0.2, mask, weights)
    assert float(loss) == pytest.approx((2.0 * -1.1 + 1.0 * -1.0) / 2, abs=1e-6)


def test_rollout_correction_needs_a_text_server():
    algo = build_algorithm(AlgorithmConfig(name="token_grpo", rollout_correction="token_truncate"))
    assert "cot_behavior_log_probs" in algo.needs
    with pytest.raises(ValueError, match="sampling.cot_backend=vllm"):
        algo.check_sampling(SamplingConfig(cot_tokens=8, cot_backend="policy"), "token")
    assert "cot_behavior_log_probs" not in build_algorithm(AlgorithmConfig(name="token_grpo")).needs
