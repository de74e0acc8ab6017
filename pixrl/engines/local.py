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
from ..algorithms.sampling import SamplerRecipe, generators, sample
from ..algorithms.token_sampling import TokenRecipe, sample_tokens, sample_with_cot
from ..artifacts.batch import RolloutBatch
from ..artifacts.checkpoints import check_trained_part, load_weights
from ..artifacts.media import wav_bytes
from ..config.schema import ExperimentConfig
from ..datasets.registry import evaluate_split, evaluator_of
from ..models.base import decode_images, negative_prompt_of, replay_negative
from ..models.source_images import condition_keys
from ..rewards.compose import RewardSet
from .base import PolicySource, TrainResult
from .policy import TrainablePolicy
from .prompt_cache import PromptCache
from .stored_policies import StoredPolicies
from .update import run_update


log = logging.getLogger("pixrl.train")


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


class LocalEngine:
    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.algorithm = build_algorithm(cfg.algorithm)
        self.rewards = RewardSet.from_config(cfg.reward, device=cfg.model.device)
        self.algorithm.bind_rewards(self.rewards)  # a loss that scores its own images reads them (srpo)
        self._policy: TrainablePolicy | None = None
        self._prompts: PromptCache | None = None
        self._cot_server = None  # sampling.cot_backend=vllm (engines/vllm_text.py)
        self.collective = None  # a trainer rank's process group (engines/collective.py); None: one process
        self.text_towers = True  # False: a trainer rank, replaying with encodings it is given (`train`)
        self.stored = StoredPolicies()  # the algorithm's stored policies (DiffusionOPD's teacher)

    @property
    def policy(self) -> TrainablePolicy:
        """Loaded on first use, so a stage that finds its output stored loads nothing."""
        if self._policy is None:
            self._load_policy()
        return self._policy

    def _load_policy(self, trainable_device: str | None = None) -> None:
        self._policy = TrainablePolicy(self.cfg, trainable_device, self.text_towers)
        self._prompts = PromptCache(self._policy.family)

    def describe(self) -> dict:
        fam = self.policy.family
        return {"family": fam.name, "semantics": fam.semantics, "latent_shape": tuple(fam.latent_shape()),
                "video": bool(getattr(fam, "video", False)), "audio": bool(getattr(fam, "audio", False)),
                "engine": "local", "torch": torch.__version__,
                **({"sigmas": fam.sigmas} if getattr(fam, "sigmas", None) is not None else {}), **fam.describe()}

    def use(self, policy: PolicySource) -> None:
        self.policy.load_version(policy.checkpoint_dir, policy.checkpoint_id, policy.ema)

    # --- rollout ------------------------------------------------------------------------------
    def rollout(self, policy: PolicySource, prompts: list[str], seeds: list[int],
                recipe: SamplerRecipe | TokenRecipe, noise_seeds: list[int] | None = None,
                rows: tuple[int, int] | None = None, on_chunk=None,
                encodings: list | None = None, images: list[bytes | None] | None = None) -> tuple[RolloutBatch, float]:
        """`rows` = (start, stop): sample only those rows of the call (a rollout worker's share;
        start a multiple of sampling.micro_batch), with the prompts encoded as the whole call
        encodes them — so the shards of a call concatenate to the whole call, bit for bit.
        `on_chunk(start, stop, decode_input)`: called as each micro-batch finishes, with its
        final latents (a token family: image tokens) on the host — reward.overlap's hook.
        `encodings` (another process's `encodings([prompts], recipe)`): the call's
        conditioning, given instead of encoded here (a rollout worker without text towers).
        `images`: each prompt's source image (an editing family)."""
        self.use(policy)
        lo, hi = rows or (0, len(prompts))
        if isinstance(recipe, TokenRecipe):
            return self._rollout_tokens(prompts, seeds, recipe, lo, hi, on_chunk)
        fam, mb = self.policy.family, self.cfg.sampling.micro_batch
        model = self._sampler(policy)
        cache = self._prompts if encodings is None else PromptCache.holding(fam, encodings)
        prompts = condition_keys(prompts, images)
        cond_all, pos = cache.encode(prompts, images)
        negative = negative_prompt_of(fam, recipe)
        negs = None if negative is None else cache.negative_rows(negative, prompts, images)
        trajs = []
        t0 = time.perf_counter()
        self.policy.module.eval()
        for start in range(lo, hi, mb):
            chunk = prompts[start:min(start + mb, hi)]
            cond = cond_all.select([pos[p] for p in chunk])
            gens = generators(seeds[start:start + len(chunk)], fam.device)
            shared = generators(noise_seeds[start:start + len(chunk)], fam.device) if noise_seeds else None
            same = _same_prefix(chunk, noise_seeds[start:start + len(chunk)]) if noise_seeds else None
            trajs.append(sample(model, cond, negs.of(chunk) if negs else None, gens, recipe, shared, same))
            if on_chunk is not None:
                on_chunk(start, start + len(chunk), _host(trajs[-1].final).astype(np.float32))
        seconds = time.perf_counter() - t0
        n = hi - lo
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
        if trajs[0].memory is not None and steps:  # a stateful guider's memory before each stored step
            batch = batch.with_columns(guidance_memory=cat("memory"))
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

    def _rollout_tokens(self, prompts: list[str], seeds: list[int], recipe: TokenRecipe,
                        lo: int, hi: int, on_chunk=None) -> tuple[RolloutBatch, float]:
        """A token family's rollout: the sampled image tokens and their teacher-forced log-probs,
        per micro-batch (the geometry replay uses)."""
        fam, mb = self.policy.family, self.cfg.sampling.micro_batch
        cond_all, pos = self._prompts.encode(prompts)
        cot = fam.encode_cot_prompts(list(pos), recipe.cot_template, recipe.cot_tokens) if recipe.cot_tokens else None
        self.policy.module.eval()
        text_sampler = self._text_sampler() if cot else None  # synced to this version once per rollout
        trajs = []
        t0 = time.perf_counter()
        for start in range(lo, hi, mb):
            chunk = prompts[start:min(start + mb, hi)]
            gens = generators(seeds[start:start + len(chunk)], fam.device)
            rows = [pos[p] for p in chunk]
            trajs.append(sample_with_cot(fam, cot, rows, gens, recipe, text_sampler) if cot
                         else sample_tokens(fam, cond_all.select(rows), gens, recipe))
            if on_chunk is not None:
                on_chunk(start, start + len(chunk), _host(trajs[-1].tokens).astype(np.int32))
        seconds = time.perf_counter() - t0
        cat = lambda name: _host(torch.cat([getattr(t, name) for t in trajs]))  # noqa: E731
        cols = {"tokens": cat("tokens").astype(np.int32), "log_probs": cat("log_probs")}
        if cot:
            cols.update(cot_tokens=cat("cot_tokens").astype(np.int32), cot_mask=cat("cot_mask").astype(np.int8),
                        cot_log_probs=cat("cot_log_probs"))
            if trajs[0].cot_behavior_log_probs is not None:  # sampled by a text server
                cols["cot_behavior_log_probs"] = cat("cot_behavior_log_probs")
        return RolloutBatch(cols), seconds

    def _text_sampler(self):
        """sampling.cot_backend=vllm: the server sampling the chain of thought, holding the
        in-memory version's text weights; None: the policy samples it here."""
        s = self.cfg.sampling
        if s.cot_backend != "vllm":
            return None
        if self._cot_server is None:
            from pathlib import Path

            from .vllm_text import VllmTextSampler

            weights = Path(self.cfg.run.workdir).resolve() / "vllm_text" / self.cfg.run.name  # where versions go to the server
            self._cot_server = VllmTextSampler(s.cot_vllm_url, weights, s.cot_vllm_model, moves=s.cot_vllm_weights,
                                               address=s.cot_vllm_address)
        self._cot_server.sync(self.policy.family, self.policy.weights_id)
        return self._cot_server

    # --- decode and score ---------------------------------------------------------------------
    def _decode_batches(self, final_latents: np.ndarray):
        """(first row, latents on the family's device) of each decode batch (a video VAE decodes a
        few clips at a time: `decode_batch`)."""
        fam = self.policy.family
        lat = torch.from_numpy(np.array(final_latents)).to(fam.device)
        n = getattr(fam, "decode_batch", 64)
        return [(i, lat[i:i + n]) for i in range(0, len(lat), n)]

    def decode(self, final_latents: np.ndarray, prompts: list[str] | None = None) -> np.ndarray:
        """Final latents (or a token family's image tokens) → uint8 images/clips; `prompts` for a
        family whose decoder reads them."""
        fam = self.policy.family
        return np.concatenate([decode_images(fam, lat, None if prompts is None else prompts[i:i + len(lat)])
                               for i, lat in self._decode_batches(final_latents)])

    def soundtracks(self, final_latents: np.ndarray) -> list[bytes] | None:
        """Each clip's soundtrack as a 16-bit WAV, for a family whose clips have sound (`audio`:
        its `decode_audio`); None for a silent family."""
        fam = self.policy.family
        if not getattr(fam, "audio", False):
            return None
        out = []
        for _, lat in self._decode_batches(final_latents):
            waves, rate = fam.decode_audio(lat)
            out += [wav_bytes(w, rate) for w in waves]
        return out

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict],
              sample_ids: list[str]) -> dict[str, np.ndarray]:
        return self.rewards.score(images, prompts, metadata, sample_ids)

    def encodings(self, prompt_sets: list[list[str]], recipe, images=None) -> dict:
        """These prompt sets' conditioning as this process encodes them (cached: the rollout's own),
        with the negative prompt's when sampling with `recipe` batches it or the algorithm guides a
        reference with it — in host memory, for a trainer rank that holds no text towers
        (`train(encodings=...)`)."""
        negative = replay_negative(self.policy.family, recipe, self.algorithm)
        return self._prompts.encodings(prompt_sets, negative, images)  # images: what an editing family's keys name

    # --- train --------------------------------------------------------------------------------
    def train(self, policy: PolicySource, batch: RolloutBatch, plan: list[list[list[int]]],
              recipe: SamplerRecipe | None, seed: int = 0, reference: PolicySource | None = None,
              prompt_sets: np.ndarray | None = None, encodings: list | None = None,
              stored: dict[str, PolicySource] | None = None) -> TrainResult:
        """`encodings` (from another process's `encodings`): the replay's prompt conditioning,
        given instead of encoded here."""
        self.use(policy)
        if reference is not None and reference.checkpoint_dir is not None:
            check_trained_part(reference.checkpoint_dir, self.cfg.model.expert)
            self.policy.set_reference(load_weights(reference.checkpoint_dir))
        self.stored.give(self.algorithm, stored or {}, self.policy, self.cfg)
        try:
            return self._train(policy, batch, plan, recipe, seed, prompt_sets, encodings)
        except BaseException:
            self.invalidate()  # weights may be half-stepped: reload from a checkpoint next time
            raise

    def _train(self, policy: PolicySource, batch: RolloutBatch, plan, recipe, seed: int, prompt_sets,
               encodings=None) -> TrainResult:
        prompts = self._prompts if encodings is None else PromptCache.holding(self.policy.family, encodings)
        return run_update(self.policy, prompts, self.algorithm, self.cfg.algorithm.max_grad_norm,
                          policy.checkpoint_dir if policy.with_optimizer else None, batch, plan, recipe, seed,
                          prompt_sets, self.collective)

    def shard(self) -> None:
        """FSDP over the trainer group this engine's rank has joined: the trained module is
        sharded, and the frozen copies the algorithm needs are made and sharded with it. Called
        before the policy is first used, only rank 0 reads the trained module's weights."""
        if self._policy is None:  # rank 0 loads the trained module into host memory, the others build it empty
            self._load_policy(trainable_device="cpu" if self.collective.rank == 0 else "meta")
        pol, algo = self.policy, self.algorithm
        explicit = self.cfg.dpo is not None and self.cfg.dpo.reference != "base"
        pol.shard(reference_copy=algo.needs_reference and (not pol.lora or explicit or algo.reference_in_state),
                  frozen_slots=(("sampler",) if algo.separate_sampler else ()) + algo.frozen_slots())

    def mark(self, checkpoint_id: str) -> None:
        self.policy.mark(checkpoint_id)

    def invalidate(self) -> None:
        if self._policy is not None:
            self._policy.invalidate()

    # --- evaluate -----------------------------------------------------------------------------
    def eval_images(self, policy: PolicySource, dataset: str, pairs: list, encoded: dict | None = None):
        """A shardable evaluator's images of these (prompt, seed) pairs under `policy`; `encoded`:
        their prompt encodings from a process with text towers (`eval_encodings`)."""
        self.use(policy)
        return evaluator_of(dataset).images(self.policy.family, pairs, self.cfg.sampling, encoded)

    def eval_encodings(self, dataset: str, pairs: list) -> dict | None:
        return evaluator_of(dataset).encodings(self.policy.family, pairs, self.cfg.sampling)

    def evaluate(self, policy: PolicySource, dataset: str, split: str, per_category: int) -> dict:
        self.use(policy)
        if dataset != self.cfg.dataset.name:
            raise ValueError(f"this engine evaluates its run's dataset {self.cfg.dataset.name!r}, not {dataset!r}")
        return evaluate_split(self.policy.family, self.cfg.dataset, split, self.cfg.sampling, per_category,
                              self.rewards)


def _same_prefix(keys: list[str], noise_seeds: list[int]) -> list[int]:
    """Per row, the first row of the micro-batch with its condition key and initial-latent seed."""
    first: dict = {}
    return [first.setdefault((k, s), i) for i, (k, s) in enumerate(zip(keys, noise_seeds))]
