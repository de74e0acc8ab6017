"""What the algorithms that backpropagate a reward model into the policy share (SRPO's Direct-Align,
DRaFT, ReFL): which families they can train — a flow-matching model with plain guidance whose
decode is differentiable — and the checks that the named reward is differentiable and scored
by the run, both before anything is written."""

from __future__ import annotations


def differentiable_family(family, variance_preserving: bool = False) -> bool:
    """A family with plain guidance whose decode is differentiable (`decode_pixels`): a flow-matching
    one, or also (`variance_preserving`) a DDPM one stepped as its equivalent flow (SD1.x, SDXL,
    PixArt-Σ) — where the algorithm needs only the policy's own steps and x̂0, not the flow's
    forward process from a clean sample (SRPO's Direct-Align does)."""
    from ..models.pipelines import decodes_pixels

    return (decodes_pixels(family) and (variance_preserving or not getattr(family, "variance_preserving", False))
            and not hasattr(family, "guidance_memory") and not getattr(family, "video", False)
            and not hasattr(family, "latent_scales"))


def check_gradient_family(algorithm: str, family, variance_preserving: bool = False) -> None:
    """Refuse a family the reward's gradient cannot reach, naming the ones it can."""
    from ..models.pipelines import decodes_pixels
    from ..models.registry import get_family, registered_families

    if differentiable_family(family, variance_preserving):
        return
    why = ("its decode is not differentiable here (a video, packed or own-normalisation decode)"
           if not decodes_pixels(family) else "it is not a flow-matching model with plain guidance (a "
           "variance-preserving schedule, or a guider whose phases follow the grid steps)")
    if variance_preserving and decodes_pixels(family):
        why = "its guider's phases follow the grid steps, or its latents have coordinates of their own"
    able = [n for n in registered_families() if differentiable_family(get_family(n), variance_preserving)]
    raise ValueError(f"algorithm '{algorithm}' backpropagates a reward through the {family.name} family's decode, "
                     f"and {why}; families it trains: {', '.join(able)}")


def check_gradient_reward(algorithm: str, name: str, rewards, able: list[str]) -> None:
    """`name` must be one of `able` (the rewards this algorithm can differentiate) and one of the
    run's rewards (weight 0 scores it without adding it to the total)."""
    if name not in able:
        raise ValueError(f"algorithm.reward={name!r}: {algorithm} needs a reward it can differentiate through its "
                         f"image path; choose one of {', '.join(able)}")
    if name not in rewards.rewards:
        raise ValueError(f"algorithm.reward={name!r} is not one of the run's rewards ({', '.join(rewards.rewards)}); "
                         f"add it to reward.weights with its options (weight 0 scores it without adding it to the "
                         f"total)")


def bound_reward(algorithm: str, rewards, name: str):
    """The run's reward `name`, set up on the rewards' device, for a loss that scores its own images."""
    if rewards is None:
        raise RuntimeError(f"{algorithm}'s loss scores its own images: its engine binds the run's rewards "
                           f"(Algorithm.bind_rewards) before an update")
    r = rewards.rewards[name]
    r.ensure_setup(rewards.device)
    return r
