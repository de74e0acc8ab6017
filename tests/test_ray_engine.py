"""The Ray engine on a local Ray cluster the tests start (CPU): sharded rollout equal to the
local engine, a 2-rank update equal to one process, two iterations of the default recipe through
the real flow, workers killed mid-stage, a reward worker that keeps failing, and an address that
answers nothing."""

import json
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.algorithms.sampling import SamplerRecipe
from pixrl.artifacts.column_writes import image_columns
from pixrl.artifacts.rollout_rows import RowSink, rows_table
from pixrl.artifacts.trajectories import StoreError, TrajectoryStore
from pixrl.cli import app
from pixrl.config.loader import load_config
from pixrl.engines.base import PolicySource
from pixrl.engines.local import LocalEngine
from pixrl.engines.ray_engine import _shards

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.serial  # five worker processes of its own: after the parallel part

RAY_RUN = ["run.engine=ray", "ray.rollout_workers=2", "ray.reward_workers=1", "ray.trainer_workers=2"]
PROMPTS = ["a red circle", "a blue square", "two green triangles", "a yellow circle"] * 5  # 20 rows, 5 micro-batches
RECIPE = SamplerRecipe(steps=4, noise_level=0.7, sde_steps=(0, 1), train_steps=(0, 1))


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray for the module (logical CPUs for 5 workers on a 2-core machine)."""
    if not ray.is_initialized():
        ray.init(num_cpus=8, object_store_memory=256 * 1024 * 1024, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def one_thread():
    """Bit-identity needs equal intra-op threads on both sides (workers run 1, the CPU each
    reserves); the test process's own count is restored, so later tests see what they expect."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _cfg(ckpt: Path, workdir: Path, *extra: str):
    """The engines' config; run.threads=1 makes the in-process local engine match the workers."""
    return load_config(None, tiny_overrides(ckpt, workdir) + RAY_RUN
                       + ["run.threads=1", "reward=jpeg_compressibility", *extra])


def test_fragments_are_shared_by_rows_and_no_worker_gets_an_empty_share():
    from pixrl.artifacts.column_writes import RowsRead
    from pixrl.engines.ray_engine import _balanced

    reads = lambda *rows: [RowsRead("u", 1, "s", i, n) for i, n in enumerate(rows)]  # noqa: E731
    ids = lambda groups: [[r.fragment_id for r in g] for g in groups]  # noqa: E731
    assert ids(_balanced(reads(8, 12), 2)) == [[0], [1]]
    assert ids(_balanced(reads(20), 2)) == [[0]]
    assert ids(_balanced(reads(4, 4, 4, 4), 2)) == [[0, 1], [2, 3]]
    assert ids(_balanced(reads(4, 4, 4), 4)) == [[0], [1], [2]]


def test_shards_cover_the_rows_in_whole_units():
    assert _shards(20, 4, 2) == [(0, 8), (8, 20)]
    assert _shards(16, 4, 2) == [(0, 8), (8, 16)]
    assert _shards(3, 4, 2) == [(0, 3)]  # fewer units than workers: one shard
    assert _shards(10, 1, 3) == [(0, 3), (3, 7), (7, 10)]


def test_sharded_rollout_decode_score_and_evaluate_equal_the_local_engine(ray_cluster, tiny_checkpoint, tmp_path):
    """Rollout worker 1 holds no text towers: worker 0 encodes the call's prompts (and the
    evaluation's) for it — the rows and images stay the local engine's, bit for bit."""
    from pixrl.engines.ray_engine import RayEngine

    cfg = _cfg(tiny_checkpoint, tmp_path)
    engine, local = RayEngine(cfg), LocalEngine(cfg)
    try:
        seeds = list(range(len(PROMPTS)))
        got, _ = engine.rollout(PolicySource(), PROMPTS, seeds, RECIPE)
        want, _ = local.rollout(PolicySource(), PROMPTS, seeds, RECIPE)
        for name in ("latents", "next_latents", "log_probs", "final_latent", "sigmas", "timesteps"):
            assert np.array_equal(got[name], want[name]), name  # whole micro-batches per worker: bit for bit
        images = engine.decode(got["final_latent"])
        assert np.array_equal(images, local.decode(want["final_latent"]))
        ids = [f"s{i}" for i in range(len(PROMPTS))]
        scores = engine.score(images, PROMPTS, [{}] * len(PROMPTS), ids)
        expect = local.score(images, PROMPTS, [{}] * len(PROMPTS), ids)
        assert set(scores) == set(expect) and all(np.array_equal(scores[k], expect[k]) for k in expect)
        assert engine.describe()["engine"] == "ray"
        towers = ray.get([w.text_tower_bytes.remote() for w in engine.rollout_workers])
        assert towers[0] > 0 and towers[1] == 0, f"worker 0 encodes for worker 1, which loads no text towers: {towers}"
        # workers write their rows as fragments; one commit holds exactly the rows a local append writes
        cols = {"run_id": ["r"] * len(PROMPTS), "iteration": [0] * len(PROMPTS), "sample_id": ids,
                "prompt_id": ids, "prompt": PROMPTS, "prompt_meta": ["{}"] * len(PROMPTS),
                "group_id": [i // 4 for i in range(len(PROMPTS))], "sample_index": [i % 4 for i in range(len(PROMPTS))],
                "seed": seeds, "policy_version": [0] * len(PROMPTS), "family": ["sd3"] * len(PROMPTS),
                "regime": ["full_sequence"] * len(PROMPTS), "step_kind": ["denoise"] * len(PROMPTS),
                "recipe": ["{}"] * len(PROMPTS)}
        remote_store, local_store = TrajectoryStore(str(tmp_path / "ray.lance")), TrajectoryStore(str(tmp_path / "local.lance"))
        sink = RowSink(remote_store.uri, cols, (), "denoise", create=True)
        fragments, schema, _ = engine.rollout_to_store(PolicySource(), PROMPTS, seeds, RECIPE, sink=sink)
        assert len(fragments) == 2  # one per worker
        ref = remote_store.commit_appended(fragments, schema, True, "r", 0)
        local_ref = local_store.append(rows_table(want, cols, (), "denoise"))
        assert ref.version == local_ref.version == 1
        assert remote_store.dataset().to_table().equals(local_store.dataset().to_table())
        with pytest.raises(StoreError, match="already holds rows"):
            remote_store.commit_appended(fragments, schema, False, "r", 0)
        # decode: workers read their fragments' latents and write the image columns; one commit
        reads = remote_store.fragment_reads(ref, "r", 0)
        assert [r.rows for r in reads] == [8, 12]
        files, _ = engine.decode_to_store(reads, "final_latent")
        with pytest.raises(StoreError, match="its worker wrote 0; nothing committed"):
            remote_store.commit_columns(reads, files[:1])
        decoded = remote_store.commit_columns(reads, files)
        local_decoded = local_store.merge(pa.table({"run_id": cols["run_id"], "iteration": cols["iteration"],
                                                    "sample_id": ids, **image_columns(images)}))
        assert decoded.version == local_decoded.version == 2
        assert remote_store.dataset().to_table().equals(local_store.dataset().to_table())
        # score: reward workers read the rows' images themselves; the rewards in sample_id order
        rows = remote_store.rows_read(decoded, "r", 0, sorted(ids))
        got_scores, _ = engine.score_from_store(rows, 0)
        order = np.argsort(ids)
        assert set(got_scores) == set(expect) and all(np.array_equal(got_scores[k], expect[k][order]) for k in expect)
        # held-out evaluation: 70 images in shards of whole generation batches (64 + 6), judged together
        got_eval = engine.evaluate(PolicySource(), "shapes", "heldout", 14)
        assert got_eval == local.evaluate(PolicySource(), "shapes", "heldout", 14) and got_eval["n"] > 64
        # a shard that splits the local engine's micro-batches runs other geometry: within 1e-6
        part, _ = local.rollout(PolicySource(), PROMPTS, seeds, RECIPE, rows=(2, 6))
        for name in ("latents", "log_probs", "final_latent"):
            np.testing.assert_allclose(part[name], want[name][2:6], rtol=0, atol=1e-6)
    finally:
        engine.close()


def _update_batch(local: LocalEngine, recipe=RECIPE):
    """The rollout's rows with advantages, and a plan of steps of 3, 1 and 1 micro-batches."""
    seeds = list(range(len(PROMPTS)))
    batch, _ = local.rollout(PolicySource(), PROMPTS, seeds, recipe)
    adv = np.linspace(-1.5, 1.5, len(PROMPTS)).astype(np.float32)
    mb = [list(range(i, i + 4)) for i in range(0, len(PROMPTS), 4)]
    ids = [f"s{i}" for i in range(len(PROMPTS))]  # as the update stage reads them with its rows
    return batch.with_columns(prompt=PROMPTS, advantage=adv, sample_id=ids), [mb[:3], [mb[3]], [mb[4]]]


def _ray_train(cfg, batch, plan, recipe, **kw):
    """The update of `batch` on the Ray engine's trainer ranks (seed 3, from the base weights)."""
    from pixrl.engines.ray_engine import RayEngine

    engine = RayEngine(cfg)
    try:
        return engine.train(PolicySource(), batch, plan, recipe, seed=3, **kw)
    finally:
        engine.close()


def _close(got: dict, want: dict, lr: float = 0.0, rtol: float = 1e-6) -> None:
    """Equal tensors up to the reduction order of a sum over ranks: 1e-6 of each tensor's scale,
    plus, for weights, 1e-2 of one Adam step (lr). Adam moves a weight by about lr whatever its
    gradient's size, and by lr·δg/eps where a gradient is near zero, so the last bits of gradients
    that nearly cancel (LoRA's B after a few steps from zero; the rows of Janus-Pro's vision head
    for tokens no rollout sampled) — which differ with the order of the sum (FSDP reduces at every
    backward, DDP once per step) and with the CPU's kernels — move the weight by a little of lr:
    measured 3.7e-5·lr on one machine, 5.2e-3·lr (that vision head; every other tensor ≤ 7.5e-4·lr)
    on an AVX-512 EPYC on 2026-12-02. A wrong gradient (a padded replay counted) moves weights by
    the order of lr; a mean instead of a sum shows in the gradient norm (the two-rank test checks it)."""
    assert set(got) == set(want)
    for k, w in want.items():
        scale = float(w.abs().max()) or 1.0
        assert float((got[k] - w).abs().max()) <= rtol * scale + 1e-2 * lr, k


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_rank_update_equals_the_single_process_update(ray_cluster, tiny_checkpoint, tmp_path, lora, sharding):
    """Steps of 3, 1 and 1 micro-batches (the rollout's own): a rank replays two of a step, or
    none of it (under FSDP: a zero-weighted replay, to keep the ranks' collectives in step). The
    full fine-tune has a KL reference (β > 0), a frozen copy that FSDP shards too. Then a second
    update resumes from the group's checkpoint: its optimizer state is in the one-process format.
    The weight average (algorithm.ema, moved after every step) comes back whole and resumes too."""
    from pixrl.artifacts.checkpoints import save_checkpoint
    from pixrl.engines.ray_engine import RayEngine

    extra = ["algorithm.lora.enabled=true", "algorithm.lora.rank=4", "algorithm.lora.alpha=8"] if lora \
        else ["algorithm.beta=0.01"]
    cfg = _cfg(tiny_checkpoint, tmp_path, "ray.rollout_workers=1", f"ray.trainer_sharding={sharding}", *extra,
               "algorithm.ema.enabled=true", "algorithm.ema.every=1")  # each rank averages its own (shards)
    local = LocalEngine(cfg)
    batch, plan = _update_batch(local)
    want = local.train(PolicySource(), batch, plan, RECIPE, seed=3)
    engine = RayEngine(cfg)
    try:
        got = engine.train(PolicySource(), batch, plan, RECIPE, seed=3)
        digests = ray.get([t.trainable_digest.remote() for t in engine.trainers])
        assert digests[0] == digests[1], "the ranks' weights drifted apart"
        held = ray.get([t.held_bytes.remote() for t in engine.trainers])
        whole = sum(w.nbytes for w in want.weights.values())
        share = 0.5 if sharding == "fsdp" else 1.0  # FSDP: each rank holds about half (shards round up)
        for h in held:
            assert h["weights"] <= share * whole * 1.05 + 4096 and h["moments"] <= 2 * share * whole * 1.05 + 8192, h
            assert h["text_towers"] == 0, "a trainer rank loaded text encoders: it replays with the rollout's encodings"
        ckpt = tmp_path / "it_0"
        ref = save_checkpoint(ckpt, got.weights, got.optimizer, {"iteration": 0}, {}, got.ema)
        source = PolicySource(ckpt, ref.checkpoint_id)
        engine.invalidate()  # the group reloads weights and moments from the checkpoint
        got2 = engine.train(source, batch, plan[:1], RECIPE, seed=4)
    finally:
        engine.close()
    assert set(got.weights) == set(want.weights) and (not lora or all("lora_" in k for k in want.weights))
    base = LocalEngine(cfg).policy.state()
    assert any(not torch.equal(want.weights[k], base[k]) for k in base), "the update changed nothing"
    lr = cfg.algorithm.lr
    _close(got.weights, want.weights, lr)
    assert got.optimizer["param_groups"] == want.optimizer["param_groups"]
    for i, st in want.optimizer["state"].items():
        _close(got.optimizer["state"][i], st, rtol=1e-4)  # moments of gradients that nearly cancel: 5e-6 measured
    resumed = LocalEngine(cfg).train(source, batch, plan[:1], RECIPE, seed=4)  # one process, same checkpoint
    _close(got2.weights, resumed.weights, lr)
    assert got.ema[1] == want.ema[1] == 3 and got2.ema[1] == resumed.ema[1] == 4
    _close(got.ema[0], want.ema[0], lr)
    _close(got2.ema[0], resumed.ema[0], lr)
    assert got.metrics["optimizer_steps"] == 3.0
    assert got.metrics["onpolicy_ratio_dev"] == 0.0
    np.testing.assert_allclose(got.metrics["grad_norm"], want.metrics["grad_norm"], rtol=1e-5)
    # the loss is a mean of −A·ρ terms of order 1 that cancel to ≈ 1e-6 at ratio 1: float32 sums of
    # them in another order differ by ≈ 1e-8 (6e-9 measured), so the bound is absolute
    np.testing.assert_allclose(got.metrics["loss"], want.metrics["loss"], rtol=1e-5, atol=1e-7)



@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_gardos_gate_and_own_reference_on_two_ranks_equal_one_process(ray_cluster, tiny_checkpoint, tmp_path,
                                                                       sharding):
    """GARDO with LoRA: the gate is computed on every rank from the whole batch's stored scores,
    the first update resets the reference (its later steps' KL passes the threshold), and the
    second update — from the group's checkpoint — trains against that reference, which the
    trainer ranks hold in a copy made when they shard. Both equal one process. (The first step
    trains from the reference itself: its KL is 0; the gated rows are in the later steps.)"""
    from pixrl.artifacts.checkpoints import save_checkpoint
    from pixrl.engines.policy import ALGORITHM_STATE
    from pixrl.engines.ray_engine import RayEngine

    cfg = _cfg(tiny_checkpoint, tmp_path, "ray.rollout_workers=1", f"ray.trainer_sharding={sharding}",
               "algorithm=gardo", "algorithm.auxiliary=[aux]", "algorithm.kl_threshold=1e-12",
               "algorithm.gate_start=0.5", "algorithm.gate_max=0.5", "algorithm.lora.rank=4", "algorithm.lora.alpha=8",
               "algorithm.ema.enabled=false")
    local = LocalEngine(cfg)
    batch, plan = _update_batch(local)
    proxy = np.linspace(0.0, 1.0, len(PROMPTS)).astype(np.float32)
    aux = proxy.copy()
    aux[[13, 17]] = 2.0  # the auxiliary ranks two samples of the later steps first: those two are gated
    batch = batch.with_columns(
        sample_id=[f"00000-{i:03d}-00" for i in range(len(PROMPTS))], reward=proxy, rewards=[[{"name": "jpeg_compressibility", "value": float(p)}, {"name": "aux", "value": float(a)}]
                               for p, a in zip(proxy, aux)])
    want = local.train(PolicySource(), batch, plan, RECIPE, seed=3)
    engine = RayEngine(cfg)
    try:
        got = engine.train(PolicySource(), batch, plan, RECIPE, seed=3)
        ckpt = tmp_path / "it_0"
        ref = save_checkpoint(ckpt, got.weights, got.optimizer, {"iteration": 0}, {}, got.ema)
        source = PolicySource(ckpt, ref.checkpoint_id)
        engine.invalidate()
        got2 = engine.train(source, batch, plan, RECIPE, seed=4)
    finally:
        engine.close()
    assert want.metrics["gardo/gated"] == got.metrics["gardo/gated"] == 2
    assert got.metrics["gardo/reference_reset"] == 1 and got.metrics["kl"] > 0
    state = got.optimizer[ALGORITHM_STATE]
    _close(state["reference"], got.weights)  # the reference: the weights after the first update
    _close(got.weights, want.weights, cfg.algorithm.lr)
    resumed = LocalEngine(cfg).train(source, batch, plan, RECIPE, seed=4)
    _close(got2.weights, resumed.weights, cfg.algorithm.lr)
    np.testing.assert_allclose(got2.metrics["kl"], resumed.metrics["kl"], rtol=1e-4)

def test_awms_frozen_copies_sharded_over_two_ranks_equal_one_process(ray_cluster, tiny_checkpoint, tmp_path):
    """AWM's full fine-tune reads three frozen copies beside the trained module — the base (its KL),
    the EMA anchor and, after the first of its three optimizer steps, the update's starting weights
    (the ratio) — each made from the base weights when the group shards and refilled per update.
    Two FSDP ranks equal one process: weights, the anchor the state carries, the ratio's range."""
    from pixrl.engines.policy import ALGORITHM_STATE

    cfg = _cfg(tiny_checkpoint, tmp_path, "ray.rollout_workers=1", "ray.trainer_sharding=fsdp", "algorithm=awm",
               "algorithm.lora.enabled=false", "algorithm.train_timesteps=2", "algorithm.optimizer_steps_per_iteration=3",
               "algorithm.lr=1e-4", "algorithm.clip_range=0.01", "algorithm.ema.enabled=false")
    recipe = SamplerRecipe(steps=4, noise_level=0.0, train_steps=())
    local = LocalEngine(cfg)
    batch, plan = _update_batch(local, recipe)
    want = local.train(PolicySource(), batch, plan, recipe, seed=3)
    got = _ray_train(cfg, batch, plan, recipe)
    lr = cfg.algorithm.lr
    _close(got.weights, want.weights, lr)
    _close(got.optimizer[ALGORITHM_STATE]["ema"], want.optimizer[ALGORITHM_STATE]["ema"], lr)
    assert got.metrics["onpolicy_ratio_dev"] == want.metrics["onpolicy_ratio_dev"] == 0.0
    assert want.metrics["ratio_max"] > 1 or want.metrics["ratio_min"] < 1  # the later steps' ratio to the start
    for key in ("ratio_max", "ratio_min", "kl", "ema_kl"):
        np.testing.assert_allclose(got.metrics[key], want.metrics[key], rtol=1e-4, atol=1e-9)


def test_a_teacher_on_two_sharded_ranks_equals_one_process(ray_cluster, tiny_checkpoint, tmp_path):
    """DiffusionOPD's teacher — a stored checkpoint of moved weights — is loaded by every rank
    into its sharded frozen copy: two FSDP ranks equal one process, and the KL to it is not 0."""
    from pixrl.artifacts.checkpoints import save_checkpoint

    cfg = _cfg(tiny_checkpoint, tmp_path, "ray.rollout_workers=1", "ray.trainer_sharding=fsdp",
               "algorithm=diffusion_opd", "algorithm.teacher=models:/t-policy/1", "algorithm.lora.enabled=false",
               "algorithm.lr=1e-4", "algorithm.ema.enabled=false")
    local = LocalEngine(cfg)
    gen = torch.Generator().manual_seed(0)
    moved = {k: v.detach() + 0.05 * torch.randn(v.shape, generator=gen)
             for k, v in local.policy.trainable_parameters().items()}
    teacher = save_checkpoint(tmp_path / "teacher", moved, {}, {"iteration": 0}, cfg.model_dump(mode="json"))
    stored = {"teacher": PolicySource(Path(teacher.uri), None, with_optimizer=False)}
    batch, plan = _update_batch(local)
    want = local.train(PolicySource(), batch, plan, RECIPE, seed=3, stored=stored)
    got = _ray_train(cfg, batch, plan, RECIPE, stored=stored)
    _close(got.weights, want.weights, cfg.algorithm.lr)
    assert want.metrics["distill_kl"] > 0
    np.testing.assert_allclose(got.metrics["distill_kl"], want.metrics["distill_kl"], rtol=1e-4)


def test_a_reward_gradient_on_two_ranks_equals_one_process(ray_cluster, tiny_checkpoint, tmp_path):
    """DRaFT's loss scores its own decoded images: every trainer rank binds the run's rewards and
    backpropagates the tiny CLIP's gradient through the last steps; two ranks equal one process."""
    from pixrl.rewards.clip_tiny import write_tiny_clip

    clip = write_tiny_clip(tmp_path / "clip", seed=0, image_size=16)
    cfg = _cfg(tiny_checkpoint, tmp_path, "ray.rollout_workers=1", "algorithm=draft", "algorithm.reward=clip_score",
               "algorithm.grad_steps=2", "reward.weights.clip_score=0.0", f"reward.options.clip_score.path={clip}",
               "algorithm.lora.enabled=false", "algorithm.lr=1e-4")
    local = LocalEngine(cfg)
    recipe = SamplerRecipe(steps=4, noise_level=0.0, sde_steps=(), train_steps=(2,))
    batch, plan = _update_batch(local, recipe)
    want = local.train(PolicySource(), batch, plan, recipe, seed=3)
    got = _ray_train(cfg, batch, plan, recipe)
    _close(got.weights, want.weights, cfg.algorithm.lr)
    assert want.metrics["draft/grad_steps"] == 2 and want.metrics["grad_norm"] > 0
    np.testing.assert_allclose(got.metrics["draft/reward"], want.metrics["draft/reward"], rtol=1e-5)


def _train(tmp_path: Path, ckpt: Path, run: str, *extra: str):
    res = CliRunner().invoke(app, ["train", "--iterations", "2", "--run", run, "reward=jpeg_compressibility",
                                   *tiny_overrides(ckpt, tmp_path), *RAY_RUN, *extra])
    return res


def _final_weights(tmp_path: Path, run: str) -> dict:
    last = sorted((tmp_path / "checkpoints" / run).glob("*/it_*"))[-1]
    return load_file(str(last / "trainable.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, prefect_harness, tiny_checkpoint, tmp_path_factory):
    """Two iterations of the default recipe on the Ray engine, with held-out evaluations."""
    work = tmp_path_factory.mktemp("ray-run")
    res = _train(work, tiny_checkpoint, "ray", "run.eval_every=1", "run.eval_per_category=1")
    assert res.exit_code == 0, res.output + repr(res.exception)
    return work, json.loads(res.stdout.strip().splitlines()[-1])


def test_two_iterations_on_the_ray_engine(uninterrupted):
    work, out = uninterrupted
    ds = lance.dataset(out["table_uri"])
    t = ds.to_table()
    assert t.num_rows == 16 and sorted(set(t["iteration"].to_pylist())) == [0, 1]
    assert all(t[c].null_count == 0 for c in ("image", "reward", "advantage", "log_probs", "latents"))
    assert {json.loads(r)["engine"] for r in t["recipe"].to_pylist()} == {"ray"}
    tags = ds.tags.list()  # one commit per table stage (generate, decode, score, replay), as the local engine
    assert {k: v["version"] for k, v in tags.items()} == {"ray-it0-generate": 1, "ray-it1-generate": 5}
    assert ds.version == 8
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    versions = client.search_model_versions(f"name='{out['model_name']}'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    metrics = client.get_run(out["run_id"]).data.metrics
    assert "heldout/accuracy" in metrics and metrics["onpolicy_ratio_dev"] == 0.0
    steps = [m.step for m in client.get_metric_history(out["run_id"], "heldout/accuracy")]
    assert steps == [0, 1, 2]


@pytest.mark.parametrize("kind", ["rollout", "trainer"])
def test_a_worker_killed_mid_stage_is_retried_and_the_run_ends_as_if_uninterrupted(kind, uninterrupted,
                                                                                  tiny_checkpoint, tmp_path,
                                                                                  monkeypatch):
    """Rollout worker 1 dies as generate begins (Ray restarts it; the stage's retry reruns), or
    trainer rank 1 dies as update begins (rank 0 fails in its collective; the group is rebuilt).
    The fragments rollout worker 0 wrote in the failed attempt are deleted: every file in the
    table's data folder is one some version lists."""
    monkeypatch.setenv("PIXRL_WORKER_FAULT", f"{kind}:1:{tmp_path / 'fired'}")
    res = _train(tmp_path, tiny_checkpoint, "ray")
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert (tmp_path / "fired").exists(), "the worker fault never fired"
    uri = json.loads(res.stdout.strip().splitlines()[-1])["table_uri"]
    ds = lance.dataset(uri)
    listed = {d.path for v in ds.versions() for f in lance.dataset(uri, version=v["version"]).get_fragments()
              for d in f.metadata.files}
    assert {p.name for p in (Path(uri) / "data").iterdir()} == listed
    want = _final_weights(uninterrupted[0], "ray")
    got = _final_weights(tmp_path, "ray")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.fixture
def failing_judge():
    """A reward service that answers /health (so preflight lets the run start) and refuses every
    /score with a scorer's 500 — a judge that fails only once scoring begins."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Judge(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 (http.server's name)
            self._send(200, {"status": "ok", "rewards": {"shapes": 1.0}, "takes": {"shapes": "image"},
                             "components": {"shapes": []}, "groupwise": []})

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self._send(500, {"detail": "scorer 'shapes' failed: RuntimeError: the judge is down"})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_reward_worker_that_keeps_failing_fails_score_naming_worker_and_samples(ray_cluster, prefect_harness,
                                                                                  tiny_checkpoint, tmp_path,
                                                                                  failing_judge):
    res = CliRunner().invoke(app, ["train", "--iterations", "1", "--run", "dead-judge", "reward=remote",
                                   f"reward.options.remote.url={failing_judge}", "reward.options.remote.retries=0",
                                   *tiny_overrides(tiny_checkpoint, tmp_path), *RAY_RUN])
    assert res.exit_code != 0
    msg = str(res.exception) + res.output
    assert "reward worker 0" in msg and "00000-000-00" in msg and failing_judge in msg and "judge is down" in msg, msg
    t = lance.dataset(str(tmp_path / "lance" / "dead-judge" / "trajectories.lance")).to_table()
    assert t.num_rows == 8 and t["reward"].null_count == 8  # generated and decoded; nothing scored was written
    assert not (tmp_path / "checkpoints" / "dead-judge").exists() or \
        not list((tmp_path / "checkpoints" / "dead-judge").glob("*/it_*"))


def test_an_address_that_answers_nothing_stops_before_any_work(tiny_checkpoint, tmp_path):
    res = CliRunner().invoke(app, ["train", "--iterations", "1", *tiny_overrides(tiny_checkpoint, tmp_path),
                                   "run.engine=ray", "ray.address=127.0.0.1:9", "ray.connect_timeout_s=2"])
    assert res.exit_code == 2, res.output
    assert "ray.address='127.0.0.1:9'" in res.output and "ray start --head" in res.output
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "lance").exists()



def test_sharded_update_of_a_family_that_calls_its_parts_directly(ray_cluster, tmp_path):
    """Janus-Pro (the token miniature, full fine-tune, KL β 0.2): its embeddings, heads and
    decoder layers are the FSDP units (`fsdp_units`), its final norm stays whole and all-reduced;
    the 2-rank sharded update equals one process's."""
    from pixrl.algorithms.token_sampling import TokenRecipe
    from pixrl.engines.ray_engine import RayEngine

    cfg = load_config("shapes_token_grpo", [f"run.workdir={tmp_path}", "run.threads=1", "sampling.micro_batch=4",
                                            "algorithm.lora.enabled=false", *RAY_RUN, "ray.rollout_workers=1",
                                            "ray.trainer_sharding=fsdp"])
    s = cfg.sampling
    recipe = TokenRecipe(s.guidance_scale, s.temperature, s.top_k)
    local = LocalEngine(cfg)
    batch, plan = _update_batch(local, recipe)
    want = local.train(PolicySource(), batch, plan, recipe, seed=3)
    engine = RayEngine(cfg)
    try:
        got = engine.train(PolicySource(), batch, plan, recipe, seed=3)
        held = ray.get([t.held_bytes.remote() for t in engine.trainers])
    finally:
        engine.close()
    whole = sum(w.nbytes for w in want.weights.values())
    assert all(h["weights"] < 0.55 * whole for h in held), (held, whole)
    _close(got.weights, want.weights, cfg.algorithm.lr)
    np.testing.assert_allclose(got.metrics["grad_norm"], want.metrics["grad_norm"], rtol=1e-5)


def test_a_group_reward_is_scored_in_whole_groups_by_the_reward_workers(ray_cluster, tiny_checkpoint, tmp_path):
    """Pref-GRPO's pairwise win rate on 2 reward workers: each gets whole groups (rows of one group
    never split between them), so the rewards equal one process's."""
    from pixrl.engines.ray_engine import RayEngine
    from pixrl.models.tiny_qwen_vl import write_tiny_qwen25_vl

    judge = write_tiny_qwen25_vl(tmp_path / "judge")
    cfg = _cfg(tiny_checkpoint, tmp_path, "ray.rollout_workers=1", "ray.reward_workers=2",
               "reward.weights={pairwise_judge: 1.0}", f"reward.options.pairwise_judge.path={judge}",
               "reward.options.pairwise_judge.decision=soft")
    images = np.random.default_rng(3).integers(0, 256, (12, 16, 16, 3), dtype=np.uint8)
    ids = [f"00000-{k // 4:03d}-{k % 4:02d}" for k in range(12)]  # 3 groups of 4: no even split of rows is whole
    prompts = [PROMPTS[k // 4] for k in range(12)]
    engine = RayEngine(cfg)
    try:
        got = engine.score(images, prompts, [{}] * 12, ids)
    finally:
        engine.close()
    want = LocalEngine(cfg).score(images, prompts, [{}] * 12, ids)
    np.testing.assert_allclose(got["pairwise_judge"], want["pairwise_judge"], atol=1e-6)
    assert np.array_equal(got["pairwise_judge.comparisons"], np.full(12, 6.0, np.float32))


def test_an_editing_family_on_the_ray_engine_equals_the_local_engine(ray_cluster, prefect_harness, tiny_flux_kontext,
                                                                   tmp_path):
    """FLUX.1 Kontext through the Ray engine: every rollout worker is given the call's source
    images (worker 1 conditions on worker 0's encodings of the instruction-and-image keys), the
    trainer ranks replay with the stored images' encodings, the reward workers read the rows'
    sources; iteration 0's rollouts equal the local engine's bit for bit."""
    path, overrides = tiny_flux_kontext
    extra = [f"{k}={v}" for k, v in overrides.items() if k != "model.path"]
    runs = {}
    for engine, args in (("local", ["run.threads=1"]), ("ray", RAY_RUN)):
        res = CliRunner().invoke(app, ["train", "--iterations", "2", "--run", f"k_{engine}", "reward=jpeg_compressibility",
                                       *tiny_overrides(path, tmp_path / engine), *extra, *args])
        assert res.exit_code == 0, res.output + repr(res.exception)
        runs[engine] = lance.dataset(json.loads(res.stdout.strip().splitlines()[-1])["table_uri"]).to_table().sort_by(
            [("iteration", "ascending"), ("sample_id", "ascending")])
    local, remote = runs["local"], runs["ray"]
    assert remote["source_image"].equals(local["source_image"]) and remote["source_image"].null_count == 0
    import pyarrow.compute as pc

    it0 = lambda t, c: t.filter(pc.equal(t["iteration"], 0))[c].combine_chunks()  # noqa: E731
    for col in ("final_latent", "log_probs", "reward"):
        assert it0(remote, col).equals(it0(local, col)), col
    assert remote["advantage"].null_count == 0


def test_a_reward_evaluation_is_sharded_and_scored_on_the_reward_workers(ray_cluster, tiny_checkpoint, tmp_path):
    """A prompt set without its own evaluator: the rollout workers make its 70 images in whole
    generation batches (worker 1 given worker 0's encodings), the reward workers score them; the
    result is the local engine's."""
    from pixrl.engines.ray_engine import RayEngine

    heldout = tmp_path / "heldout.txt"
    heldout.write_text("a yellow star\nthree white circles\na red square\n")
    cfg = _cfg(tiny_checkpoint, tmp_path, "dataset=text_prompts", f"dataset.path={heldout}",
               f"dataset.heldout_path={heldout}")
    engine, local = RayEngine(cfg), LocalEngine(cfg)
    try:
        got = engine.evaluate(PolicySource(), "text", "heldout", 70)
        want = local.evaluate(PolicySource(), "text", "heldout", 70)
    finally:
        engine.close()
    assert got == want and got["n"] == 70 and got["metric"] == "reward"


def test_an_iteration_in_parts_on_the_ray_engine_equals_the_local_engine(ray_cluster, prefect_harness, tiny_checkpoint,
                                                                        tmp_path):
    """TempFlow-GRPO's branch steps through the Ray engine: each part is its own sharded call whose
    workers write fragments, committed as one version; iteration 0's rows equal the local
    engine's bit for bit (each part's stored step, shared base latents, log-probs, rewards) and
    the trainer ranks replay every part."""
    extra = ["--config", "shapes_tempflow_grpo", "algorithm.children=2", "algorithm.branch_steps=[0,2]"]
    unwindowed = {"sampling.window_size": "null", "sampling.window_range": "null"}
    runs = {}
    for engine, args in (("local", ["run.threads=1"]), ("ray", RAY_RUN)):
        res = CliRunner().invoke(app, ["train", "--iterations", "2", "--run", f"t_{engine}", "reward=jpeg_compressibility",
                                       *extra, *tiny_overrides(tiny_checkpoint, tmp_path / engine, **unwindowed),
                                       *args])
        assert res.exit_code == 0, res.output + repr(res.exception)
        runs[engine] = lance.dataset(json.loads(res.stdout.strip().splitlines()[-1])["table_uri"]).to_table().sort_by(
            [("iteration", "ascending"), ("sample_id", "ascending")])
    local, remote = runs["local"], runs["ray"]
    import pyarrow.compute as pc

    it0 = lambda t, c: t.filter(pc.equal(t["iteration"], 0))[c].combine_chunks()  # noqa: E731
    assert remote.num_rows == local.num_rows == 32
    for col in ("stored_steps", "noise_seed", "latents", "log_probs", "final_latent", "reward", "advantage"):
        assert it0(remote, col).equals(it0(local, col)), col
    assert set(pc.unique(it0(remote, "group_id")).to_pylist()) == {0, 1, 2, 3}
    assert remote["advantage"].null_count == 0


def test_one_step_off_rollouts_run_ahead_on_the_workers_and_equal_the_local_engine(ray_cluster, prefect_harness,
                                                                                  tiny_checkpoint, tmp_path):
    """run.staleness=1: iteration i + 1's rollout is begun on the rollout workers while iteration i
    trains, and committed by its generate stage — the same rows and weights as the local engine,
    which generates in the stage, bit for bit."""
    import pyarrow.compute as pc

    runs, outs = {}, {}
    stale = ["--iterations", "3", "run.staleness=1", "algorithm.optimizer_steps_per_iteration=2", "algorithm.lr=1e-3"]
    for engine, args in (("local", ["run.threads=1"]),
                         ("ray", ["run.engine=ray", "ray.rollout_workers=2", "ray.reward_workers=1",
                                  "ray.trainer_workers=1"])):
        res = CliRunner().invoke(app, ["train", "--run", f"s_{engine}", "reward=jpeg_compressibility", *stale,
                                       *tiny_overrides(tiny_checkpoint, tmp_path / engine), *args])
        assert res.exit_code == 0, res.output + repr(res.exception)
        outs[engine] = json.loads(res.stdout.strip().splitlines()[-1])
        runs[engine] = lance.dataset(outs[engine]["table_uri"]).to_table().sort_by(
            [("iteration", "ascending"), ("sample_id", "ascending")])
    local, remote = runs["local"], runs["ray"]
    assert remote.num_rows == local.num_rows == 24
    assert [pc.unique(remote.filter(pc.equal(remote["iteration"], i))["policy_version"]).to_pylist() for i in range(3)] \
        == [[0], [0], [1]]
    for col in ("latents", "log_probs", "final_latent", "reward", "advantage"):
        assert remote[col].combine_chunks().equals(local[col].combine_chunks()), col
    want, got = _final_weights(tmp_path / "local", "s_local"), _final_weights(tmp_path / "ray", "s_ray")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    client = MlflowClient(f"sqlite:///{tmp_path / 'ray' / 'mlflow.db'}")
    waited = client.get_metric_history(outs["ray"]["run_id"], "prefetch/wait_s")
    assert sorted(m.step for m in waited) == [1, 2]  # iterations 1 and 2 were generated ahead
    local_client = MlflowClient(f"sqlite:///{tmp_path / 'local' / 'mlflow.db'}")
    assert not local_client.get_metric_history(outs["local"]["run_id"], "prefetch/wait_s")  # generated in the stage


@pytest.mark.parametrize("sharding,cap", [("ddp", None), ("fsdp", 1.0001)])
def test_an_off_policy_update_on_two_ranks_recomputes_each_ranks_rows(ray_cluster, tiny_checkpoint, tmp_path,
                                                                      sharding, cap):
    """run.staleness=1: rows the base weights sampled, trained from the weights after one update.
    Each rank recomputes the old log-probs of the micro-batches it replays (FSDP: the padding
    replays too, in lockstep); the first step's ratio is exactly 1 on every rank and the update
    equals one process's; the drift's extremes are gathered over the ranks. With a behaviour
    weight cap (FSDP, its padding rows absent from a rank's weights) the weighted update runs on
    every rank and its truncation is gathered (tests/test_staleness.py shows the weight changes
    an update)."""
    from pixrl.artifacts.checkpoints import save_checkpoint
    from pixrl.engines.ray_engine import RayEngine

    cfg = _cfg(tiny_checkpoint, tmp_path, "ray.rollout_workers=1", f"ray.trainer_sharding={sharding}",
               "algorithm.lora.enabled=true", "algorithm.lora.rank=4", "algorithm.lora.alpha=8",
               "algorithm.lr=1e-2", "run.staleness=1", *([f"run.staleness_weight_cap={cap}"] if cap else []))
    local = LocalEngine(cfg)
    batch, plan = _update_batch(local)
    first = local.train(PolicySource(), batch, plan, RECIPE, seed=3)
    assert first.metrics["off_policy/log_ratio_abs_mean"] == 0.0  # sampled by the weights it starts from
    ckpt = tmp_path / "it_0"
    source = PolicySource(ckpt, save_checkpoint(ckpt, first.weights, first.optimizer, {"iteration": 0}, {}).checkpoint_id)
    want = LocalEngine(cfg).train(source, batch, plan, RECIPE, seed=4)
    engine = RayEngine(cfg)
    try:
        got = engine.train(source, batch, plan, RECIPE, seed=4)
    finally:
        engine.close()
    assert want.metrics["off_policy/log_ratio_abs_mean"] > 0
    assert got.metrics["onpolicy_ratio_dev"] == want.metrics["onpolicy_ratio_dev"] == 0.0
    for key in ("off_policy/ratio_max", "off_policy/ratio_min"):
        np.testing.assert_allclose(got.metrics[key], want.metrics[key], rtol=1e-6)
    if cap:  # some weights truncated at the cap, on both (the ranks' means are averaged: not the one mean)
        assert want.metrics["off_policy/weight_capped_frac"] > 0 and got.metrics["off_policy/weight_capped_frac"] > 0
    _close(got.weights, want.weights, cfg.algorithm.lr)


def test_a_distributed_generate_that_fails_before_its_commit_leaves_no_files(ray_cluster, prefect_harness,
                                                                              tiny_checkpoint, tmp_path, monkeypatch):
    """The fault point is after the rollout workers wrote their fragments and before the stage's
    one commit; every file in the table's data folder is then one some version lists."""
    from pixrl.stages.chaos import ENV

    monkeypatch.setenv(ENV, "generate@1:raise")
    res = CliRunner().invoke(app, ["train", "--iterations", "2", "--run", "stray", "reward=jpeg_compressibility",
                                   *tiny_overrides(tiny_checkpoint, tmp_path), "run.engine=ray",
                                   "ray.rollout_workers=2", "ray.reward_workers=1", "ray.trainer_workers=1"])
    assert res.exit_code == 1 and "injected fault in generate" in res.output, res.output
    uri = str(tmp_path / "lance" / "stray" / "trajectories.lance")
    assert sorted(set(lance.dataset(uri).to_table(columns=["iteration"])["iteration"].to_pylist())) == [0]
    ds = lance.dataset(uri)
    listed = {d.path for v in ds.versions() for f in lance.dataset(uri, version=v["version"]).get_fragments()
              for d in f.metadata.files}
    assert {p.name for p in (Path(uri) / "data").iterdir()} == listed


def test_a_family_that_decodes_with_its_prompts_on_the_ray_engine_equals_the_local_engine(ray_cluster, prefect_harness,
                                                                                        tmp_path_factory, tmp_path):
    """GLM-Image's autoregressive model (`glm_image_ar`): its decoder renders each row's prompt
    (glyph embeddings, prompt-seeded noise), so the rollout workers that decode the stored tokens
    (`decode_to_store`) read each row's prompt beside them; iteration 0's tokens, images and
    rewards equal the local engine's bit for bit, and differ from a decode given other prompts."""
    from pixrl.models.glm_image_ar import GlmImageArFamily

    path = tmp_path_factory.mktemp("ckpt") / "tiny-glm-image"
    overrides = GlmImageArFamily.write_tiny(path, seed=0)
    extra = [f"{k}={v}" for k, v in overrides.items() if k != "model.path"]
    runs = {}
    for engine, args in (("local", ["run.threads=1"]), ("ray", [*RAY_RUN, "ray.trainer_workers=1"])):
        res = CliRunner().invoke(app, ["train", "--iterations", "1", "--run", f"g_{engine}", "reward=jpeg_compressibility",
                                       "algorithm=token_grpo", "sampling.prompts_per_iteration=4",
                                       *tiny_overrides(path, tmp_path / engine), *extra, *args])
        assert res.exit_code == 0, res.output + repr(res.exception)
        runs[engine] = lance.dataset(json.loads(res.stdout.strip().splitlines()[-1])["table_uri"]).to_table().sort_by(
            [("sample_id", "ascending")])
    local, remote = runs["local"], runs["ray"]
    for col in ("tokens", "image", "reward"):
        assert remote[col].combine_chunks().equals(local[col].combine_chunks()), col
    assert len(set(local["prompt"].to_pylist())) > 1
    fam = GlmImageArFamily.load(path, max_sequence_length=64, resolution=64, decoder_steps=4)
    tokens = torch.from_numpy(np.stack(local["tokens"].to_numpy(zero_copy_only=False))[:2].astype(np.int64))
    from pixrl.artifacts.media import decode_media

    prompts = local["prompt"].to_pylist()
    other = next(p for p in prompts if p not in prompts[:2])
    stored = np.stack([decode_media(b) for b in local["image"].to_pylist()[:2]])
    # the test's own decode (another batch shape and thread count than the run's): within 1 of 8 bits
    assert np.abs(fam.decode(tokens, prompts[:2]).astype(int) - stored).max() <= 1
    assert np.abs(fam.decode(tokens, [other, other]).astype(int) - stored).max() > 1


def test_a_family_with_a_guidance_memory_on_the_ray_engine_equals_the_local_engine(ray_cluster, prefect_harness,
                                                                                  tmp_path_factory, tmp_path):
    """HunyuanImage-2.1 under its APG guiders: the rollout workers store each transition's momentum
    (`guidance_memory`) in the fragments they write, and the two trainer ranks replay their rows
    with it (a rank without it could not: replay refuses); the rows equal the local engine's bit
    for bit, memory included, and the update published a version."""
    from pixrl.models.hunyuan_image import HunyuanImageFamily

    path = tmp_path_factory.mktemp("ckpt") / "tiny-hunyuan-image"
    overrides = HunyuanImageFamily.write_tiny(path, seed=0)
    extra = [f"{k}={v}" for k, v in overrides.items() if k != "model.path"]
    runs = {}
    for engine, args in (("local", ["run.threads=1"]), ("ray", RAY_RUN)):
        res = CliRunner().invoke(app, ["train", "--iterations", "1", "--run", f"h_{engine}", "reward=jpeg_compressibility",
                                       "sampling.guidance_scale=3.5", "sampling.steps=6", "sampling.prompts_per_iteration=4",
                                       *tiny_overrides(path, tmp_path / engine), *extra, *args])
        assert res.exit_code == 0, res.output + repr(res.exception)
        out = json.loads(res.stdout.strip().splitlines()[-1])
        runs[engine] = lance.dataset(out["table_uri"]).to_table().sort_by([("sample_id", "ascending")])
        versions = MlflowClient(f"sqlite:///{tmp_path / engine / 'mlflow.db'}").search_model_versions(
            f"name='{out['model_name']}'")
        assert [int(v.version) for v in versions] == [1], engine  # the update published its version
    local, remote = runs["local"], runs["ray"]
    for col in ("guidance_memory", "latents", "log_probs", "final_latent", "reward", "advantage"):
        assert remote[col].combine_chunks().equals(local[col].combine_chunks()), col
    assert np.abs(np.stack(remote["guidance_memory"].to_numpy(zero_copy_only=False))).sum() > 0
