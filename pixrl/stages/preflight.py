"""Checks a config against the world before anything is written: model path, family, the
algorithm's needs against what the family's rollouts store, prompt set, rewards. Every failure
is a PreflightError that names the problem and the fix."""

from __future__ import annotations

from ..algorithms.base import ALGORITHMS, build_algorithm
from ..artifacts.batch import rollout_fields
from ..config.schema import ExperimentConfig
from ..datasets.prompts import load_prompt_set, select_categories
from ..errors import ExpectedError
from ..models.base import ModelLoadError, check_layout
from ..models.registry import get_family, image_taking_families, registered_families
from ..rewards.compose import RewardSet
from ..engines.assets import resolve_asset, resolve_model_path


class PreflightError(ExpectedError, RuntimeError):
    pass


def preflight(cfg: ExperimentConfig, online: bool = True) -> None:
    """`online`: the config trains in the online loop (else: offline from archived rollouts)."""
    try:
        family = get_family(cfg.model.family)
        algo = build_algorithm(cfg.algorithm)
        if online and algo.offline:
            raise ValueError(f"algorithm {algo.name!r} trains from archived rollouts, not in the online loop; "
                             f"run it with `pixrl dpo --from RUN`, or choose an online algorithm")
        if online:
            check_online_algorithm(cfg, algo, family)
        if cfg.model.frames and not getattr(family, "video", False):
            raise ValueError(f"model.frames={cfg.model.frames}: the {family.name} family makes images, not clips; "
                             "unset model.frames (or choose a video family such as wan)")
        size = cfg.model.size()  # (height, width) where either is set; an unset side is known only at load
        if getattr(family, "square_only", "") and isinstance(size, tuple) and None not in size and size[0] != size[1]:
            raise ValueError(f"model.height={cfg.model.height}, model.width={cfg.model.width}: the {family.name} "
                             f"family makes square images ({family.square_only}); set model.resolution only")
        if cfg.model.offload_text_encoders and not hasattr(family, "offload_text_towers"):
            raise ValueError(f"model.offload_text_encoders: the {family.name} family has no separate text encoder to "
                             "offload (its language model is the policy); set it to false")
        options = cfg.model.family_options()
        unread = sorted(set(options) - set(getattr(family, "options", {})))
        if unread:
            readers = [n for n in registered_families() if unread[0] in getattr(get_family(n), "options", {})]
            raise ValueError(f"model.{unread[0]}={options[unread[0]]}: the {family.name} family does not read it "
                             f"({', '.join(readers)} do); unset it")
        check_model_sampling(cfg)
        path = resolve_model_path(cfg.model.path)
        if hasattr(family, "check_checkpoint"):  # not a diffusers pipeline (a transformers model)
            family.check_checkpoint(path)
        else:
            check_layout(path, family.pipeline_class, family.name, skip=getattr(family, "unread_components", ()))
        if hasattr(family, "check_options"):  # the checkpoint's own settings against model.*
            family.check_options(path, options, cfg.sampling)
        items = select_categories(load_prompt_set(resolve_asset(cfg.dataset.path), cfg.dataset.name),
                                  cfg.dataset.categories)
        check_source_images(cfg, family, items)
        algo.check_prompt_meta([it.meta for it in items])
        s = cfg.sampling
        check_sampling_settings(s, family, algo)
        if hasattr(family, "check_prompts"):  # a token family: prompt + image tokens within the context
            family.check_prompts(path, [it.prompt for it in items], cfg.model.max_sequence_length,
                                 s.cot_tokens, s.cot_template)
        if cfg.run.engine == "ray":  # Ray installed and its cluster answering, before anything is written
            from ..engines.ray_cluster import RayUnavailable, check_address

            try:
                check_address(cfg.ray)
            except RayUnavailable as exc:
                raise ValueError(str(exc)) from None
        check_rewards(cfg, family, algo, items)
    except (KeyError, ValueError, FileNotFoundError, ModelLoadError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        raise PreflightError(msg) from None


def check_rewards(cfg: ExperimentConfig, family, algo, items) -> None:
    """The configured rewards (a served set's as its server describes it): installed, able to score
    this family's media and these prompts, storing every score the algorithm and
    reward.advantage_weights read, whole groups for a group reward (in rollouts and in the
    held-out evaluation)."""
    rewards = RewardSet.from_config(cfg.reward)
    rewards.connect()
    rewards.check_media(getattr(family, "video", False), getattr(family, "audio", False))
    if rewards.groupwise:
        check_group_scoring(cfg, [n for n, r in rewards.rewards.items() if r.groupwise])
        check_group_evaluation(cfg, [n for n, r in rewards.rewards.items() if r.groupwise])
    rewards.check_installed()
    rewards.check_advantage_parts(cfg.reward.advantage_weights)
    rewards.check_scores(algo.scores_read(), f"algorithm {algo.name!r}")
    algo.check_rewards(rewards)
    metas = [{**it.meta, **({"source_image": it.image} if it.image else {})} for it in items]
    rewards.check_scores_everywhere(algo.scores_read(), f"algorithm {algo.name!r}", metas)
    rewards.check_prompts([it.prompt for it in items], metas)


def check_model_sampling(cfg: ExperimentConfig) -> None:
    """model.sigmas is every sampling grid, so the rollouts' and the evaluation's steps are its
    length; model.dynamic_cfg changes a CFG scale, so there must be CFG."""
    if cfg.model.dynamic_cfg and cfg.sampling.guidance_scale <= 1.0:
        raise ValueError("model.dynamic_cfg: sampling.guidance_scale=1 batches no classifier-free guidance, so no "
                         "scale would change; set sampling.guidance_scale > 1 (CogVideoX's scripts: 6) or unset it")
    if cfg.model.sigmas is None:
        return
    n, s = len(cfg.model.sigmas), cfg.sampling
    wrong = [f"sampling.{k}={v}" for k, v in (("steps", s.steps), ("eval_steps", s.eval_steps)) if v != n]
    if wrong:
        raise ValueError(f"model.sigmas holds {n} noise levels, and {' and '.join(wrong)}: every sampling grid is "
                         f"model.sigmas; set {' and '.join(w.split('=')[0] for w in wrong)} to {n}")


def check_sampling_settings(s, family, algo) -> None:
    """Sampling settings only some families read are refused where nothing would read them."""
    if s.cot_tokens and not hasattr(family, "encode_cot_prompts"):
        raise ValueError(f"sampling.cot_tokens={s.cot_tokens}: the {family.name} family samples no chain of thought "
                         f"(token families such as janus_pro do); set sampling.cot_tokens=0")
    cfg_only = [k for k, on in (("negative_prompt", bool(s.negative_prompt)), ("cfg_truncation", s.cfg_truncation < 1))
                if on]
    if cfg_only and getattr(family, "guidance", "cfg") != "cfg":
        cfg_families = [n for n in registered_families() if getattr(get_family(n), "guidance", "cfg") == "cfg"]
        raise ValueError(f"sampling.{cfg_only[0]}: the {family.name} family's guidance is "
                         f"{family.guidance} (no negative-prompt batch), so it would never be read; unset it "
                         f"(classifier-free guidance families read it: {', '.join(cfg_families)})")
    if s.cot_tokens and algo.offline:
        raise ValueError(f"sampling.cot_tokens={s.cot_tokens}: {algo.name!r} scores image tokens after the plain "
                         f"prompt; it does not train on chains of thought yet — set sampling.cot_tokens=0")


def check_online_algorithm(cfg: ExperimentConfig, algo, family) -> None:
    """The algorithm can train on this family's rollouts with these sampling and reward settings."""
    algo.check_sampling(cfg.sampling, family.semantics.step.value)
    algo.check_family(family, cfg.model)
    if algo.cfg_free and getattr(family, "guidance", "cfg") == "cfg" and cfg.sampling.guidance_scale != 1:
        raise ValueError(f"algorithm {algo.name!r} is CFG-free: set sampling.guidance_scale=1 (got "
                         f"{cfg.sampling.guidance_scale}; the {family.name} family guides with a negative-prompt batch)")
    if cfg.run.staleness_weight_cap is not None and not algo.behaviour_weighted:
        weighted = [n for n in ALGORITHMS.names() if ALGORITHMS.get(n).behaviour_weighted]
        raise ValueError(f"run.staleness_weight_cap: algorithm {algo.name!r} takes no behaviour weight (its loss has "
                         f"no per-transition ratio to the sampling policy); unset it, or choose one that does: "
                         f"{', '.join(weighted)}")
    if algo.pairs_in_groups and cfg.reward.aggregate != "reward":
        raise ValueError(f"algorithm {algo.name!r} pairs each group's best and worst rollout by the total reward; "
                         f"reward.aggregate={cfg.reward.aggregate} sums per-reward advantages — set "
                         f"reward.aggregate=reward")
    if algo.advantage_scores() and cfg.reward.advantage_parts() is not None:
        raise ValueError(f"algorithm {algo.name!r} computes its advantages from the scores it names "
                         f"({', '.join(algo.advantage_scores())}); reward.aggregate=advantage normalises each reward "
                         f"apart — set reward.aggregate=reward")
    if algo.reward_history and cfg.reward.advantage_parts() is not None:
        raise ValueError(f"algorithm {algo.name!r} normalises each prompt's total reward by its history; "
                         f"reward.aggregate=advantage normalises each reward apart — set reward.aggregate=reward")
    lacking = sorted(set(algo.needs) - rollout_fields(family.semantics))
    if lacking:
        raise ValueError(f"algorithm {algo.name!r} needs trajectory field(s) {lacking}, which {cfg.model.family!r} "
                         f"rollouts ({family.semantics.step.value} steps) do not store")


def check_source_images(cfg: ExperimentConfig, family, items) -> None:
    """An editing-only family gets a source image with every prompt, a family that also edits
    (FLUX.2) all or none, a text-to-image family none."""
    from ..models.source_images import SEP

    with_image = sum(it.image is not None for it in items)
    where = f"dataset.path={cfg.dataset.path}"
    if getattr(family, "needs_images", False) and with_image < len(items):
        raise ValueError(f"the {family.name} family {family.image_use}, and {len(items) - with_image} of the "
                         f"{len(items)} prompts of {where} have no source image; give each an image (docs/editing.md)")
    if with_image and not getattr(family, "takes_images", False):
        raise ValueError(f"{with_image} prompts of {where} carry source images (an editing dataset), and the "
                         f"{family.name} family generates from text alone; use a family that takes them "
                         f"({image_taking_families()}) or a prompt set without images")
    if 0 < with_image < len(items):
        raise ValueError(f"{with_image} of the {len(items)} prompts of {where} carry source images: a prompt set is "
                         f"all edits or all text-to-image; split it in two")
    bad = next((it.prompt for it in items if SEP in it.prompt), None)
    if bad is not None:
        raise ValueError(f"prompt {bad[:60]!r} of {where} holds the control character U+001F; remove it")


def check_group_evaluation(cfg, names: list[str]) -> None:
    """A held-out evaluation by the run's rewards groups its samples by prompt: with a group
    reward, each held-out prompt needs at least two samples (seeds) of its own."""
    from ..datasets.prompts import split_items
    from ..datasets.registry import evaluates, has_evaluator
    from ..datasets.reward_eval import reward_eval_pairs

    if not cfg.run.eval_every or not evaluates(cfg.dataset) or has_evaluator(cfg.dataset.name):
        return
    pairs = reward_eval_pairs(split_items(cfg.dataset, "heldout"), cfg.run.eval_per_category)
    counts: dict[str, int] = {}
    for item, _ in pairs:
        counts[item.prompt] = counts.get(item.prompt, 0) + 1
    alone = [p for p, n in counts.items() if n < 2]
    if alone:
        raise ValueError(f"reward(s) {names} compare each sample with the others of its prompt, and the held-out "
                         f"evaluation (run.eval_per_category={cfg.run.eval_per_category}) gives {len(alone)} prompt(s) "
                         f"one sample, e.g. {alone[0][:60]!r}: raise run.eval_per_category to at least twice the "
                         "largest category's prompt count of dataset.heldout_path, or set run.eval_every=0")


def check_group_scoring(cfg, names: list[str]) -> None:
    """A reward that compares each sample with its group (pairwise_judge) needs whole groups in
    every scored batch: reward.overlap scores micro-batches, so they must hold whole groups."""
    s = cfg.sampling
    if cfg.reward.overlap and s.micro_batch % s.group_size:
        raise ValueError(f"reward.overlap scores each micro-batch as it is generated, and {names} need whole "
                         f"groups: set sampling.micro_batch to a multiple of sampling.group_size={s.group_size} "
                         f"(it is {s.micro_batch}), or reward.overlap=false")
