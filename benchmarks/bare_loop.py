"""The bare loop: the default recipe's iteration as plain torch — same model, prompts, sampler
recipe, batch geometry, reward, advantages, loss and optimizer — with no Prefect, Lance, MLflow,
checkpoints or records. `online_loop.py` runs it beside the pipeline and reports the ratio of
median iteration wall times, i.e. what the stage layer and the stores cost.

    .venv/bin/python benchmarks/bare_loop.py --iterations 5 [key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pixrl.algorithms.advantages import group_advantages
from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.losses import ppo_clip_loss
from pixrl.algorithms.recipe import rollout_recipe
from pixrl.algorithms.sampling import generators, replay_step, sample
from pixrl.config.loader import load_config
from pixrl.datasets.prompts import choose_prompts, load_prompt_set, select_categories
from pixrl.engines.assets import resolve_asset, resolve_model_path
from pixrl.models.registry import get_family
from pixrl.rewards.compose import RewardSet
from pixrl.stages.plan import seed_of


class BareLoop:
    """Flow-GRPO on the configured family, everything in memory."""

    def __init__(self, cfg, init_weights: dict | None = None):
        """`init_weights`: trainable weights to start from (a checkpoint's), instead of the base."""
        if cfg.algorithm.optimizer_steps_per_iteration != 1 or cfg.sampling.guidance_scale > 1:
            raise SystemExit("the bare loop mirrors one optimizer step per iteration without CFG (the default recipe)")
        self.cfg = cfg
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        m = cfg.model
        self.fam = get_family(m.family).load(resolve_model_path(m.path), dtype=m.dtype, device=m.device,
                                             max_sequence_length=m.max_sequence_length)
        module = self.fam.trainable_module().requires_grad_(True)
        if init_weights is not None:
            missing, unexpected = module.load_state_dict(init_weights, strict=False)
            params = {n for n, _ in module.named_parameters()}
            if unexpected or params & set(missing):
                raise SystemExit(f"the checkpoint does not match the trainable module: unexpected {unexpected[:3]}, "
                                 f"missing {sorted(params & set(missing))[:3]}")
        a = cfg.algorithm
        self.params = list(module.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=a.lr, betas=a.adam_betas, eps=a.adam_eps,
                                     weight_decay=a.weight_decay)
        d = cfg.dataset
        self.items = select_categories(load_prompt_set(resolve_asset(d.path), d.name), d.categories)
        self.reward = RewardSet(cfg.reward.weights, cfg.reward.options)
        self.grpo = build_algorithm(cfg.algorithm).settings  # Flow-GRPO's clip range, advantage settings
        self.phases: dict[str, list[float]] = {}  # seconds per phase per iteration, for the comparison

    def _encode(self, prompts: list[str]):
        uniq = sorted(set(prompts))
        with torch.no_grad():
            cond = self.fam.encode_prompts(uniq)
        return cond.select([uniq.index(p) for p in prompts])

    def iteration(self, it: int) -> float:
        cfg, s, a, fam = self.cfg, self.cfg.sampling, self.grpo, self.fam
        t0 = time.perf_counter()
        rng = np.random.default_rng(seed_of(cfg.run.seed, it, 0))
        chosen = choose_prompts(self.items, s.prompts_per_iteration, rng)
        recipe = rollout_recipe(s, rng)
        rows = [(slot, g, p) for slot, p in enumerate(chosen) for g in range(s.group_size)]
        prompts = [p.prompt for _, _, p in rows]
        cond = self._encode(prompts)
        fam.trainable_module().eval()
        t_gen = time.perf_counter()
        trajs = []
        for i in range(0, len(rows), s.micro_batch):
            seeds = [seed_of(cfg.run.seed, it, 1, slot, g) for slot, g, _ in rows[i:i + s.micro_batch]]
            trajs.append(sample(fam, cond.select(list(range(i, i + len(seeds)))), None,
                                generators(seeds, fam.device), recipe))
        t_dec = time.perf_counter()
        images = np.concatenate([fam.decode(t.final) for t in trajs])
        t_score = time.perf_counter()
        scores = self.reward.score(images, prompts, [p.meta for _, _, p in rows], [str(i) for i in range(len(rows))])
        adv = group_advantages(scores["reward"], np.array([slot for slot, _, _ in rows]), a.global_std, a.std_eps,
                               a.adv_clip_max).advantages
        t_upd = time.perf_counter()
        fam.trainable_module().train()
        self.opt.zero_grad(set_to_none=True)
        keep = [i for i in range(len(rows)) if adv[i] != 0 or not a.filter_zero_advantage]
        steps = list(recipe.train_steps)
        micro = [keep[i:i + s.micro_batch] for i in range(0, len(keep), s.micro_batch)]
        for mb in micro:
            t_of = lambda name: torch.cat([getattr(trajs[i // s.micro_batch], name)[i % s.micro_batch:i % s.micro_batch + 1]  # noqa: E731
                                           for i in mb])
            lat, nxt, old = t_of("latents"), t_of("next_latents"), t_of("log_probs")
            for j, k in enumerate(steps):
                out = replay_step(fam, lat[:, j], nxt[:, j], k, trajs[0].sigmas, trajs[0].timesteps,
                                  cond.select(mb), None, recipe)
                loss, _ = ppo_clip_loss(out.log_prob, old[:, j], torch.from_numpy(adv[mb]), a.clip_range,
                                        a.adv_clip_max)
                (loss / (len(micro) * len(steps))).backward()
        torch.nn.utils.clip_grad_norm_(self.params, cfg.algorithm.max_grad_norm)
        self.opt.step()
        t_end = time.perf_counter()
        for name, a_, b_ in (("generate", t_gen, t_dec), ("decode", t_dec, t_score), ("score", t_score, t_upd),
                             ("update", t_upd, t_end)):
            self.phases.setdefault(name, []).append(b_ - a_)
        return t_end - t0


def run_bare(overrides: list[str], iterations: int, start: int = 0, init_checkpoint=None) -> list[float]:
    """Wall seconds of iterations start..start+iterations-1 (their prompts and seeds), from the
    base weights or from `init_checkpoint`'s (the weights the pipeline's iteration `start` used)."""
    init = None
    if init_checkpoint is not None:
        from pixrl.artifacts.checkpoints import load_weights

        init = load_weights(init_checkpoint)
    loop = BareLoop(load_config(None, overrides), init)
    return [loop.iteration(it) for it in range(start, start + iterations)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--start", type=int, default=0, help="first iteration (its prompts and seeds)")
    ap.add_argument("--init-checkpoint", default=None, help="start from this checkpoint's trainable weights")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    walls = run_bare(a.overrides, a.iterations, a.start, a.init_checkpoint)
    print(f"bare loop: median {statistics.median(walls[1:] or walls):.2f} s/iteration over {len(walls)} "
          f"({', '.join(f'{w:.2f}' for w in walls)})")


if __name__ == "__main__":
    main()
