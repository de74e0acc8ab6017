"""What each dataset plugs in, by dataset name (`dataset.name`):

- an evaluator `evaluate(family, split, sampling, per_category) -> dict` with at least `accuracy`
  (the headline number) and `n`; a dataset without one cannot be evaluated (run.eval_every is
  ignored for it);
- optionally a prompt-metadata parser `parse(text) -> dict` for prompt files that carry no
  metadata column (the shapes world reads objects, counts and relations from its template text).

Generic modules (the prompt loader, the stage layer, engines) look these up here and never
import a dataset's world.
"""

from __future__ import annotations

from ..config.registry import Registry


def _builtin() -> None:
    from .shapes import evaluate, prompts  # noqa: F401  (registers "shapes")


EVALUATORS: Registry = Registry("evaluator", "evaluators", _builtin)
register_evaluator = EVALUATORS.register
PROMPT_PARSERS: Registry = Registry("prompt parser", "prompt parsers", _builtin)
register_prompt_parser = PROMPT_PARSERS.register


def get_evaluator(dataset: str):
    return EVALUATORS.get(dataset)


def has_evaluator(dataset: str) -> bool:
    return dataset in EVALUATORS.names()


def evaluates(dataset_cfg) -> bool:
    """Whether a run on this dataset config has a held-out split to evaluate: its own evaluator's,
    or the held-out prompts the run's rewards score (datasets/reward_eval.py)."""
    return dataset_cfg.heldout_path is not None


def evaluator_of(dataset: str, score=None):
    """The dataset's own evaluator, or the run's rewards as one (datasets/reward_eval.py), scoring
    with `score` (a RewardSet's or an engine's; only the aggregate uses it)."""
    from .reward_eval import RewardEvaluator

    return get_evaluator(dataset) if has_evaluator(dataset) else RewardEvaluator(score)


def evaluate_split(family, dataset_cfg, split: str, sampling, per_category: int, rewards) -> dict:
    """The dataset's own evaluator on the split, or — a dataset without one — the run's rewards
    (`rewards`, a RewardSet) on it."""
    from .prompts import split_items

    evaluator = evaluator_of(dataset_cfg.name, rewards.score)
    return evaluator(family, split_items(dataset_cfg, split), sampling, per_category)


def prompt_parser(dataset: str):
    """The dataset's metadata parser, or None when it has none (prompts then carry `{}`)."""
    return PROMPT_PARSERS.get(dataset) if dataset in PROMPT_PARSERS.names() else None
