"""One update: optimizer steps over the plan's micro-batches with the configured algorithm's
losses, replaying the stored rows through the loaded policy — the same code in one process and
on every rank of a trainer group (`collective`: which micro-batches are this rank's, how the
gradients and the step metrics are summed over the ranks).

The update's own randomness (DanceGRPO's trained steps, DiffusionNFT's and Diffusion-DPO's noise
levels and noise) comes from one generator per micro-batch, seeded from (update seed, optimizer
step, micro-batch), so a micro-batch draws the same numbers whichever rank replays it.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..algorithms.replay import ReplayPolicy, TokenReplayPolicy, trained_grid_steps
from ..algorithms.token_sampling import TokenRecipe
from ..artifacts.batch import RolloutBatch
from ..models.base import replay_negative
from ..models.source_images import condition_keys
from ..stages.plan import seed_of
from .base import TrainResult
from .collective import SingleProcess
from .optimizers import learning_rate, set_learning_rate
from .policy import ALGORITHM_STATE, TrainablePolicy
from .proximal import proximal_batch
from .prompt_cache import PromptCache

log = logging.getLogger("pixrl.train")


FROZEN_ONLY = ("no loss term of this optimizer step depends on the trained weights: frozen weights compute every "
               "step it could train (a two-expert checkpoint's other expert, whose steps the SDE window or the "
               "algorithm's timesteps fell on) — put the window on model.expert's steps")


def set_of_rows(n: int, prompt_sets) -> np.ndarray:
    """Per row, the prompt set the rollout encoded it in (None: one set, the whole batch)."""
    return np.zeros(n, np.int64) if prompt_sets is None else np.asarray(prompt_sets)


def replay_prompt_sets(prompts, prompt_sets) -> dict[int, list[str]]:
    """The prompt sets a replay of these rows encodes ({set: its rows' prompts}), as the rollout did."""
    sets = set_of_rows(len(prompts), prompt_sets)
    return {int(s): [p for p, k in zip(prompts, sets) if k == s] for s in np.unique(sets)}


class ReplayFactory:
    """The replay view of a micro-batch's rows: their conditioning as the rollout encoded it
    (one prompt set per dynamic-sampling round), the rollout's schedule and guidance."""

    def __init__(self, pol: TrainablePolicy, prompts: PromptCache, algo, batch: RolloutBatch, recipe, prompt_sets,
                 seed: int | None = None):
        fam = pol.family
        self.seed = seed  # the update's: randomness every micro-batch of it shares (ReplayPolicy.update_seed)
        self.pol, self.fam, self.batch, self.recipe = pol, fam, batch, recipe
        images = list(batch["source_image"]) if "source_image" in batch else None
        self.prompts = condition_keys(list(batch["prompt"]), images)  # an editing rollout's: prompt and image
        self.sets = set_of_rows(len(self.prompts), prompt_sets)
        sets = replay_prompt_sets(self.prompts, prompt_sets)
        self.encoded = {s: prompts.encode(texts, images) for s, texts in sets.items()}
        self.cots = {s: fam.encode_cot_prompts(list(pos), recipe.cot_template, recipe.cot_tokens)  # CoT: per set
                     for s, (_, pos) in self.encoded.items()} \
            if isinstance(recipe, TokenRecipe) and recipe.cot_tokens else {}
        negative = replay_negative(fam, recipe, algo)  # as the rollout sampled (the rows' recorded recipe)
        self.negs = {} if negative is None else {s: prompts.negative_rows(negative, texts, images)
                                                   for s, texts in sets.items()}
        if algo.needs_reference and algo.reference_in_state:  # the algorithm's own (GARDO's adaptive one)
            weights = algo.reference_weights()
            if weights is None:
                pol.use_base_reference()
            else:
                pol.set_reference(weights)
        self.reference = pol.reference() if algo.needs_reference else None
        self.sampler = None
        if algo.separate_sampler:  # the sampling policy as of the rollout (initially the weights themselves)
            if algo.sampling_weights() is None:
                algo.set_sampling_weights({k: v.detach().clone() for k, v in pol.state().items()})
            weights = algo.sampling_weights()  # still None: the rollouts sampled with the weights (DGPO's before its switch)
            self.sampler = None if weights is None else pol.frozen_view(weights)
        slots = algo.frozen_slots()
        start = pol.state() if slots else {}
        self.frozen = {name: pol.frozen_view(algo.frozen_weights(name, start), slot=name) for name in slots}
        on_device = lambda name: torch.from_numpy(batch[name][0].copy()).to(fam.device) if name in batch else None  # noqa: E731
        self.sigmas, self.timesteps = on_device("sigmas"), on_device("timesteps")
        self.trained_steps = trained_grid_steps(fam, self.timesteps)

    def __call__(self, rows: list[int], gen: torch.Generator) -> ReplayPolicy | TokenReplayPolicy:
        fam, recipe = self.fam, self.recipe
        (s, *more) = {self.sets[i] for i in rows}
        if more:
            raise ValueError(f"a micro-batch spans prompt sets {sorted({s, *more})}; plan micro-batches within one")
        cond_all, pos = self.encoded[s]
        set_rows = [pos[self.prompts[i]] for i in rows]
        if self.cots:  # the image prompts embed the stored chains of thought
            cot = self.cots[s]
            on = lambda name: torch.from_numpy(np.asarray(self.batch[name])[rows]).to(fam.device)  # noqa: E731
            cond = fam.cot_image_prompts(cot, set_rows, on("cot_tokens").long(), on("cot_mask").long())
            return TokenReplayPolicy(fam, self.reference, cond, recipe, fam.device, cot.text.select(set_rows))
        cond = cond_all.select(set_rows)
        if isinstance(recipe, TokenRecipe):
            return TokenReplayPolicy(fam, self.reference, cond, recipe, fam.device)
        neg = self.negs[s].of([self.prompts[i] for i in rows]) if self.negs else None
        return ReplayPolicy(fam, self.reference, cond, neg, self.sigmas, self.timesteps, recipe, fam.device, gen,
                            self.sampler, self.trained_steps, self._memory(rows), self.frozen, self.seed)

    def _memory(self, rows: list[int]) -> dict[int, torch.Tensor] | None:
        """The guider's stored memory of the rows' transitions by grid step (guidance_memory), or None."""
        if "guidance_memory" not in self.batch:
            return None
        stored, steps = np.asarray(self.batch["guidance_memory"])[rows], self.batch["stored_steps"][rows[0]]
        return {int(k): torch.from_numpy(np.ascontiguousarray(stored[:, j])).to(self.fam.device)
                for j, k in enumerate(steps) if k >= 0}


def _aggregate(key: str, vals: list[float]) -> float:
    agg = np.min if key in ("ratio_min", "off_policy/ratio_min") else np.max \
        if key in ("ratio_max", "onpolicy_ratio_dev", "off_policy/ratio_max") else np.mean
    return float(agg(vals))


def run_update(pol: TrainablePolicy, prompts: PromptCache, algo, max_grad_norm: float, checkpoint_dir,
               batch: RolloutBatch, plan: list[list[list[int]]], recipe, seed: int, prompt_sets,
               collective=None) -> TrainResult:
    """Optimizer steps from the loaded weights (+ the optimizer state of `checkpoint_dir`)."""
    coll = collective or SingleProcess()
    fam = pol.family
    opt = pol.ensure_optimizer(checkpoint_dir)
    algo.load_state(pol.algorithm_state)
    prepared = algo.prepare_update(batch)
    if recipe is None and fam.semantics.step.value == "token":  # offline: the algorithm's scored policy
        recipe = getattr(algo, "token_recipe", None) or TokenRecipe()
    replay_policy = ReplayFactory(pol, prompts, algo, batch, recipe, prompt_sets, seed)
    acc: dict[str, list[float]] = {key: [val] for key, val in prepared.items()}
    pol.module.train()  # the loss's mode: the recomputed log-probs are the ones its first step computes
    algo.set_behaviour_weights(None)  # this update's own, if any (proximal_batch)
    if pol.cfg.run.staleness:  # older samples: the old log-probs are the update's starting weights'
        t_prox = time.perf_counter()
        batch, drift = proximal_batch(algo, batch, plan, replay_policy, coll, fam.device, seed,
                                      pol.cfg.run.staleness_weight_cap)
        if drift:
            drift["off_policy/recompute_s"] = [time.perf_counter() - t_prox]
        for part in coll.gather(drift):  # every rank's rows
            for key, vals in part.items():
                acc.setdefault(key, []).extend(vals)
    named = pol.trainable_parameters()
    params = list(named.values())
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()
    for opt_step, step_batches in enumerate(plan):
        set_learning_rate(opt, learning_rate(pol.cfg.algorithm, pol.optimizer_steps + opt_step))
        opt.zero_grad(set_to_none=True)
        n_terms = sum(algo.terms(batch.select(mb), replay_policy.trained_steps) for mb in step_batches)
        if not n_terms and replay_policy.trained_steps is not None:  # every rank counts the whole step: alike
            raise RuntimeError(FROZEN_ONLY)
        mine, graded, calls = _backward_terms(algo, batch, step_batches, replay_policy, coll, fam.device, seed,
                                              opt_step, n_terms)
        parts = coll.gather((mine, graded, calls))  # every rank's, in rank order: decided alike on every rank
        if sum(p[2] for p in parts) and not sum(p[1] for p in parts):
            raise RuntimeError(FROZEN_ONLY)
        step_acc: dict[str, list[float]] = {}
        for part, _, _ in parts:
            for key, vals in part.items():
                step_acc.setdefault(key, []).extend(vals)
                acc.setdefault(key, []).extend(vals)
        coll.reduce_gradients(params)
        gnorm = coll.clip_grad_norm(params, max_grad_norm)
        acc.setdefault("grad_norm", []).append(float(gnorm))
        opt.step()
        if pol.ema is not None:
            pol.ema.after_optimizer_step(named, len(step_batches))
        step_means = {**{k: float(np.mean(v)) for k, v in step_acc.items()}, "grad_norm": float(gnorm)}
        for key, val in algo.after_optimizer_step(step_means).items():
            acc.setdefault(key, []).append(val)
            step_means[key] = val
        history.append(step_means)
        if (opt_step + 1) % 25 == 0 or opt_step + 1 == len(plan):
            log.info("update step %d/%d  loss %.4f", opt_step + 1, len(plan), history[-1].get("loss", float("nan")))
    seconds = time.perf_counter() - t0
    pol.module.eval()
    return _result(pol, algo, opt, len(plan), acc, history, seconds)


def _result(pol: TrainablePolicy, algo, opt, steps: int, acc: dict[str, list[float]], history: list[dict],
            seconds: float) -> TrainResult:
    """The update's weights, saved optimizer state (with the algorithm's own and the run's step
    count) and metrics."""
    metrics = {"update_compute_s": seconds, "lr": opt.param_groups[0]["lr"], "optimizer_steps": float(steps)}
    metrics.update(algo.end_of_update(pol.state(), steps))
    metrics.update({key: _aggregate(key, vals) for key, vals in acc.items()})
    pol.algorithm_state = algo.state()
    pol.optimizer_steps += steps  # the state's step count, as the checkpoint will hold it
    saved = pol.optimizer_state(pol.optimizer_steps)
    if pol.algorithm_state is not None:
        saved = {**saved, ALGORITHM_STATE: pol.algorithm_state}
    weights = pol.state()
    ema = None
    if pol.ema is not None:
        ema = (pol.ema.state(), pol.ema.steps)
        metrics.update(ema_metrics(weights, ema[0], ema[1]))
    return TrainResult(weights, saved, metrics, history, ema)


def ema_metrics(weights: dict[str, torch.Tensor], average: dict[str, torch.Tensor], steps: int) -> dict[str, float]:
    """How far the weight average trails the weights: ‖θ − ema‖ / ‖θ‖ over every trained tensor."""
    gap = sum(float(torch.sum((w.double() - average[k].double()) ** 2)) for k, w in weights.items())
    norm = sum(float(torch.sum(w.double() ** 2)) for w in weights.values())
    return {"ema/relative_gap": (gap / norm) ** 0.5 if norm else 0.0, "ema/optimizer_steps": float(steps)}


def _backward_terms(algo, batch: RolloutBatch, step_batches, replay_policy, coll, device, seed: int, opt_step: int,
                    n_terms: int) -> tuple[dict[str, list[float]], int, int]:
    """One optimizer step's loss terms, backpropagated (this rank's share): their metrics, how many
    depend on the trained weights (a frozen expert's step does not: its gradient is zero, so it is
    not backpropagated), and how many there were."""
    mine: dict[str, list[float]] = {}
    graded = calls = 0
    for j, mb, weight in coll.share(step_batches):
        gen = torch.Generator(device=device).manual_seed(seed_of(seed, opt_step, j))
        for loss, m in algo.losses(batch.select(mb), replay_policy(mb, gen)):
            graded, calls = graded + int(loss.requires_grad), calls + 1
            if weight != 1.0:  # a sharded rank's lockstep padding: the same calls, no contribution
                if loss.requires_grad:
                    (loss * weight / n_terms).backward()
                continue
            if opt_step == 0 and "ratio_max" in m:  # before any update: off-policy drift is numerics only
                m["onpolicy_ratio_dev"] = torch.max(torch.abs(m["ratio_max"] - 1), torch.abs(m["ratio_min"] - 1))
            if loss.requires_grad:
                (loss / n_terms).backward()
            m["loss"] = loss.detach()
            for key, val in m.items():
                mine.setdefault(key, []).append(float(val))
    return mine, graded, calls
