"""The local engine: every computation of an RL iteration in this process, on the configured
device — compute only (the stage layer decides, records and commits).

The loaded model is cached per process and reloads weights only when the requested policy
differs from what is in memory. Tensors stay on the model's device until they leave as the
rollout batch (the store boundary), where they move to host once.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..algorithms.base import build_algorithm
from ..algorithms.replay import ReplayPolicy, TokenReplayPolicy
from ..algorithms.sampling import SamplerRecipe, generators, sample
from ..algorithms.token_sampling import TokenRecipe, sample_tokens, sample_with_cot
from ..artifacts.batch import RolloutBatch
from ..artifacts.checkpoints import load_weights
from ..config.schema import ExperimentConfig
from ..datasets.prompts import split_items
from ..datasets.registry import get_evaluator
from ..models.base import uses_negative_prompt
from ..rewards.compose import RewardSet
from .base import PolicySource, TrainResult
from .policy import ALGORITHM_STATE, TrainablePolicy
from .prompt_cache import PromptCache


log = logging.getLogger("pixrl.train")


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


class LocalEngine:
    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.algorithm = build_algorithm(cfg.algorithm)
        self.rewards = RewardSet(cfg.reward.weights, cfg.reward.options, device=cfg.model.device)
        self._policy: TrainablePolicy | None = None
        self._prompts: PromptCache | None = None

    @property
    def policy(self) -> TrainablePolicy:
        """Loaded on first use, so a stage that finds its output stored loads nothing."""
        if self._policy is None:
            self._policy = TrainablePolicy(self.cfg)
            self._prompts = PromptCache(self._policy.family)
        return self._policy

    def describe(self) -> dict:
        fam = self.policy.family
        return {"family": fam.name, "semantics": fam.semantics, "latent_shape": tuple(fam.latent_shape()),
                "video": bool(getattr(fam, "video", False)), "engine": "local", "torch": torch.__version__,
                **fam.describe()}

    def use(self, policy: PolicySource) -> None:
        self.policy.load_version(policy.checkpoint_dir, policy.checkpoint_id)

    # --- rollout ------------------------------------------------------------------------------
    def rollout(self, policy: PolicySource, prompts: list[str], seeds: list[int],
                recipe: SamplerRecipe | TokenRecipe, noise_seeds: list[int] | None = None) -> tuple[RolloutBatch, float]:
        self.use(policy)
        if isinstance(recipe, TokenRecipe):
            return self._rollout_tokens(prompts, seeds, recipe)
        fam, mb = self.policy.family, self.cfg.sampling.micro_batch
        model = self._sampler(policy)
        cond_all, pos = self._prompts.encode(prompts)
        neg = self._prompts.negative() if uses_negative_prompt(fam, recipe.guidance_scale) else None
        trajs = []
        t0 = time.perf_counter()
        self.policy.module.eval()
        for start in range(0, len(prompts), mb):
            chunk = prompts[start:start + mb]
            cond = cond_all.select([pos[p] for p in chunk])
            gens = generators(seeds[start:start + len(chunk)], fam.device)
            shared = generators(noise_seeds[start:start + len(chunk)], fam.device) if noise_seeds else None
            trajs.append(sample(model, cond, neg.expand(len(chunk)) if neg else None, gens, recipe, shared))
        seconds = time.perf_counter() - t0
        n = len(prompts)
        steps = recipe.padded_steps()
        pad = len(steps) - len(recipe.train_steps)

        def cat(name: str) -> np.ndarray:  # transitions padded with zeros up to stored_width
            out = _host(torch.cat([getattr(t, name) for t in trajs]))
            if pad and name != "final":
                out = np.concatenate([out, np.zeros((n, pad, *out.shape[2:]), out.dtype)], axis=1)
            return out

        tile = lambda a: np.tile(_host(a), (n, 1))  # noqa: E731
        batch = RolloutBatch({
            "timesteps": tile(trajs[0].timesteps), "sigmas": tile(trajs[0].sigmas),
            "stored_steps": np.tile(np.array(steps, np.int32), (n, 1)),
            "latents": cat("latents"), "next_latents": cat("next_latents"), "log_probs": cat("log_probs"),
            "final_latent": cat("final"),
        })
        if "means" in self.algorithm.needs:
            batch = batch.with_columns(means=cat("means"))
        return batch, seconds

    def _sampler(self, policy: PolicySource):
        """What the rollout samples with: the family (the published weights), or a frozen view
        with the algorithm's own sampling weights, read from that version's algorithm state."""
        if not self.algorithm.separate_sampler:
            return self.policy.family
        pol = self.policy
        pol.ensure_optimizer(policy.checkpoint_dir if policy.with_optimizer else None)
        self.algorithm.load_state(pol.algorithm_state)
        weights = self.algorithm.sampling_weights()
        return self.policy.family if weights is None else pol.frozen_view(weights)

    def _rollout_tokens(self, prompts: list[str], seeds: list[int], recipe: TokenRecipe) -> tuple[RolloutBatch, float]:
        """A token family's rollout: the sampled image tokens and their teacher-forced log-probs,
        per micro-batch (the geometry replay uses)."""
        fam, mb = self.policy.family, self.cfg.sampling.micro_batch
        cond_all, pos = self._prompts.encode(prompts)
        cot = fam.encode_cot_prompts(list(pos), recipe.cot_template, recipe.cot_tokens) if recipe.cot_tokens else None
        self.policy.module.eval()
        trajs = []
        t0 = time.perf_counter()
        for start in range(0, len(prompts), mb):
            chunk = prompts[start:start + mb]
            gens = generators(seeds[start:start + len(chunk)], fam.device)
            rows = [pos[p] for p in chunk]
            trajs.append(sample_with_cot(fam, cot, rows, gens, recipe) if cot
                         else sample_tokens(fam, cond_all.select(rows), gens, recipe))
        seconds = time.perf_counter() - t0
        cat = lambda name: _host(torch.cat([getattr(t, name) for t in trajs]))  # noqa: E731
        cols = {"tokens": cat("tokens").astype(np.int32), "log_probs": cat("log_probs")}
        if cot:
            cols.update(cot_tokens=cat("cot_tokens").astype(np.int32), cot_mask=cat("cot_mask").astype(np.int8),
                        cot_log_probs=cat("cot_log_probs"))
        return RolloutBatch(cols), seconds

    # --- decode and score ---------------------------------------------------------------------
    def decode(self, final_latents: np.ndarray) -> np.ndarray:
        """Final latents (or a token family's image tokens) → uint8 images/clips."""
        fam = self.policy.family
        lat = torch.from_numpy(np.array(final_latents)).to(fam.device)
        n = getattr(fam, "decode_batch", 64)  # a video VAE decodes a few clips at a time
        return np.concatenate([fam.decode(lat[i:i + n]) for i in range(0, len(lat), n)])

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict],
              sample_ids: list[str]) -> dict[str, np.ndarray]:
        return self.rewards.score(images, prompts, metadata, sample_ids)

    # --- train --------------------------------------------------------------------------------
    def train(self, policy: PolicySource, batch: RolloutBatch, plan: list[list[list[int]]],
              recipe: SamplerRecipe | None, seed: int = 0, reference: PolicySource | None = None,
              prompt_sets: np.ndarray | None = None) -> TrainResult:
        self.use(policy)
        if reference is not None and reference.checkpoint_dir is not None:
            self.policy.set_reference(load_weights(reference.checkpoint_dir))
        try:
            return self._train(policy, batch, plan, recipe, seed, prompt_sets)
        except BaseException:
            self.invalidate()  # weights may be half-stepped: reload from a checkpoint next time
            raise

    def _train(self, policy: PolicySource, batch: RolloutBatch, plan, recipe, seed: int, prompt_sets) -> TrainResult:
        pol, algo, fam = self.policy, self.algorithm, self.policy.family
        opt = pol.ensure_optimizer(policy.checkpoint_dir if policy.with_optimizer else None)
        algo.load_state(pol.algorithm_state)
        prompts = batch["prompt"]
        # the prompts as the rollout encoded them: one set per generation round
        sets = np.zeros(len(prompts), np.int64) if prompt_sets is None else np.asarray(prompt_sets)
        encoded = {s: self._prompts.encode([p for p, k in zip(prompts, sets) if k == s]) for s in np.unique(sets)}
        cots = {s: fam.encode_cot_prompts(list(pos), recipe.cot_template, recipe.cot_tokens)  # CoT: per set, too
                for s, (_, pos) in encoded.items()} if isinstance(recipe, TokenRecipe) and recipe.cot_tokens else {}
        if recipe is None and fam.semantics.step.value == "token":  # offline: the algorithm's scored policy
            recipe = getattr(algo, "token_recipe", None) or TokenRecipe()
        neg = self._prompts.negative() if recipe is not None and uses_negative_prompt(fam, recipe.guidance_scale) else None
        reference = pol.reference() if algo.needs_reference else None
        sampler = None
        if algo.separate_sampler:  # the sampling policy as of the rollout (initially the weights themselves)
            if algo.sampling_weights() is None:
                algo.set_sampling_weights({k: v.detach().clone() for k, v in pol.state().items()})
            sampler = pol.frozen_view(algo.sampling_weights())
        on_device = lambda name: torch.from_numpy(batch[name][0].copy()).to(fam.device) if name in batch else None  # noqa: E731
        sigmas, timesteps = on_device("sigmas"), on_device("timesteps")
        gen = torch.Generator(device=fam.device).manual_seed(seed)

        def replay_policy(rows: list[int]) -> ReplayPolicy | TokenReplayPolicy:
            (s, *more) = {sets[i] for i in rows}
            if more:
                raise ValueError(f"a micro-batch spans prompt sets {sorted({s, *more})}; plan micro-batches within one")
            cond_all, pos = encoded[s]
            set_rows = [pos[prompts[i]] for i in rows]
            if cots:  # the image prompts embed the stored chains of thought
                cot = cots[s]
                on = lambda name: torch.from_numpy(np.asarray(batch[name])[rows]).to(fam.device)  # noqa: E731
                cond = fam.cot_image_prompts(cot, set_rows, on("cot_tokens").long(), on("cot_mask").long())
                return TokenReplayPolicy(fam, reference, cond, recipe, fam.device, cot.text.select(set_rows))
            cond = cond_all.select(set_rows)
            if isinstance(recipe, TokenRecipe):
                return TokenReplayPolicy(fam, reference, cond, recipe, fam.device)
            return ReplayPolicy(fam, reference, cond, neg.expand(len(rows)) if neg else None, sigmas, timesteps,
                                recipe, fam.device, gen, float(fam.scheduler.config.num_train_timesteps), sampler)

        pol.module.train()
        params = list(pol.trainable_parameters().values())
        acc: dict[str, list[float]] = {}
        history: list[dict[str, float]] = []
        t0 = time.perf_counter()
        for opt_step, step_batches in enumerate(plan):
            step_acc: dict[str, list[float]] = {}
            opt.zero_grad(set_to_none=True)
            n_terms = sum(algo.terms(batch.select(mb)) for mb in step_batches)
            for mb in step_batches:
                for loss, m in algo.losses(batch.select(mb), replay_policy(mb)):
                    if opt_step == 0 and "ratio_max" in m:  # before any update: off-policy drift is numerics only
                        m["onpolicy_ratio_dev"] = torch.max(torch.abs(m["ratio_max"] - 1), torch.abs(m["ratio_min"] - 1))
                    (loss / n_terms).backward()
                    m["loss"] = loss.detach()
                    for key, val in m.items():
                        acc.setdefault(key, []).append(float(val))
                        step_acc.setdefault(key, []).append(float(val))
            gnorm = torch.nn.utils.clip_grad_norm_(params, self.cfg.algorithm.max_grad_norm)
            acc.setdefault("grad_norm", []).append(float(gnorm))
            opt.step()
            step_means = {**{k: float(np.mean(v)) for k, v in step_acc.items()}, "grad_norm": float(gnorm)}
            for key, val in algo.after_optimizer_step(step_means).items():
                acc.setdefault(key, []).append(val)
                step_means[key] = val
            history.append(step_means)
            if (opt_step + 1) % 25 == 0 or opt_step + 1 == len(plan):
                log.info("update step %d/%d  loss %.4f", opt_step + 1, len(plan), history[-1].get("loss", float("nan")))
        seconds = time.perf_counter() - t0
        pol.module.eval()
        metrics = {"update_compute_s": seconds, "lr": opt.param_groups[0]["lr"], "optimizer_steps": float(len(plan))}
        metrics.update(algo.end_of_update(pol.state(), len(plan)))
        for key, vals in acc.items():
            agg = np.min if key == "ratio_min" else np.max if key in ("ratio_max", "onpolicy_ratio_dev") else np.mean
            metrics[key] = float(agg(vals))
        pol.algorithm_state = algo.state()
        saved = opt.state_dict()
        if pol.algorithm_state is not None:
            saved = {**saved, ALGORITHM_STATE: pol.algorithm_state}
        return TrainResult(pol.state(), saved, metrics, history)

    def mark(self, checkpoint_id: str) -> None:
        self.policy.mark(checkpoint_id)

    def invalidate(self) -> None:
        if self._policy is not None:
            self._policy.invalidate()

    # --- evaluate -----------------------------------------------------------------------------
    def evaluate(self, policy: PolicySource, dataset: str, split: str, per_category: int) -> dict:
        self.use(policy)
        items = split_items(self.cfg.dataset, split)
        return get_evaluator(dataset)(self.policy.family, items, self.cfg.sampling, per_category)
