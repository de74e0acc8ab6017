"""algorithm.ema: the moving average of the trained weights that flow_grpo evaluates and saves
(decay min((1+n)/(10+n), d) after the run's optimizer step n, moved when (n+1) % every == 0;
algorithms.md §2.6) — kept in every checkpoint, carried across iterations, replayed bit for bit,
and what evaluation, `pixrl eval/generate --run` and `pixrl export-model` use by default."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.artifacts.checkpoints import EMA, EMA_STEPS, MissingEma
from pixrl.cli import app
from pixrl.config.schema import EmaConfig, ExperimentConfig
from pixrl.engines.base import PolicySource
from pixrl.engines.ema import WeightAverage
from pixrl.stages.publish import evaluated_weights

EVERY, DECAY = 3, 0.9


def reference_average(start: dict, steps: list[dict], every: int, decay: float) -> dict:
    """flow_grpo's EMAModuleWrapper.step(params, global_step) called after each optimizer step,
    written from the formula: ema ← ema + (1 − d)(θ − ema), d = min((1+n)/(10+n), decay), when
    (n + 1) % every == 0 — with n the 1-based count of optimizer steps taken."""
    ema = {k: v.clone().float() for k, v in start.items()}
    for n, weights in enumerate(steps, start=1):
        if (n + 1) % every == 0:
            d = min((1 + n) / (10 + n), decay)
            for k in ema:
                ema[k].add_((1 - d) * (weights[k].float() - ema[k]))
    return ema


def test_the_average_follows_flow_grpos_formula():
    gen = torch.Generator().manual_seed(0)
    start = {"a": torch.randn(5, 3, generator=gen), "b": torch.randn(7, generator=gen)}
    steps = [{k: v + 0.1 * (n + 1) * torch.randn(v.shape, generator=gen) for k, v in start.items()} for n in range(20)]
    for every in (1, 8):
        avg = WeightAverage.starting_at(EmaConfig(enabled=True, decay=DECAY, every=every), start)
        moved = [avg.after_optimizer_step(w) for w in steps]
        assert moved == [(n + 1) % every == 0 for n in range(1, 21)]
        want = reference_average(start, steps, every, DECAY)
        assert avg.steps == 20 and all(torch.equal(avg.state()[k], want[k]) for k in want)
    # the warm-up caps the decay while the average is young: after step 1 it is 2/11, not 0.9
    avg = WeightAverage.starting_at(EmaConfig(enabled=True, decay=DECAY, every=1), {"a": torch.zeros(1)})
    avg.after_optimizer_step({"a": torch.ones(1)})
    assert torch.allclose(avg.state()["a"], torch.tensor([9 / 11]))


def test_flow_grpos_count_per_micro_batch_is_k_updates_with_the_same_weights():
    """flow_grpo calls ema.step once per micro-batch with the optimizer-step count: at a due step
    of k micro-batches the same θ is averaged in k times, ema ← θ − d^k (θ − ema)."""
    gen = torch.Generator().manual_seed(1)
    start, theta = {"a": torch.randn(6, generator=gen)}, {"a": torch.randn(6, generator=gen)}
    avg = WeightAverage.starting_at(EmaConfig(enabled=True, every=1, per_micro_batch=True), start, steps=20)
    avg.after_optimizer_step(theta, micro_batches=3)
    d = min(22 / 31, 0.9)
    want = start["a"].clone()
    for _ in range(3):
        want.add_((1 - d) * (theta["a"] - want))
    torch.testing.assert_close(avg.state()["a"], want, rtol=0, atol=1e-6)


def test_a_bf16_weight_is_averaged_in_float32():
    start = {"w": torch.ones(4, dtype=torch.bfloat16)}
    avg = WeightAverage.starting_at(EmaConfig(enabled=True, decay=0.999, every=1), start, steps=10_000)
    avg.after_optimizer_step({"w": torch.full((4,), 1.0078125, dtype=torch.bfloat16)})  # the next bf16 value
    assert avg.state()["w"].dtype == torch.float32 and 1.0 < float(avg.state()["w"][0]) < 1.0001


def _ok(args):
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    return res


@pytest.fixture(scope="module")
def ema_run(tiny_checkpoint, tmp_path_factory, prefect_harness):
    """3 iterations of 2 optimizer steps each with the average moved every 3 steps: after steps 2
    and 5 — in iterations 0 and 2, not in 1."""
    wd = tmp_path_factory.mktemp("ema")
    res = _ok(["train", "-n", "3", "--run", "E", "--seed", "5", "reward=jpeg_compressibility",
               "algorithm.ema.enabled=true", f"algorithm.ema.every={EVERY}", f"algorithm.ema.decay={DECAY}",
               "algorithm.optimizer_steps_per_iteration=2",
               *tiny_overrides(tiny_checkpoint, wd, **{"run.eval_every": 3, "run.eval_per_category": 1,
                                                       "run.eval_trained": "true"})])
    out = json.loads(res.stdout.strip().splitlines()[-1])
    cks = sorted((wd / "checkpoints" / "E" / out["run_id"]).glob("it_*"))
    assert len(cks) == 3
    return wd, out, cks


def _steps(ck: Path) -> int:
    with safe_open(str(ck / EMA), "pt") as f:
        return int(f.metadata()[EMA_STEPS])


def test_checkpoints_hold_the_average_over_the_runs_optimizer_steps(ema_run, tiny_checkpoint):
    wd, out, cks = ema_run
    trained = [load_file(str(ck / "trainable.safetensors")) for ck in cks]
    average = [load_file(str(ck / EMA)) for ck in cks]
    assert [_steps(ck) for ck in cks] == [2, 4, 6]
    base = load_file(str(tiny_checkpoint / "transformer" / "diffusion_pytorch_model.safetensors"))
    base = {k: base[k] for k in trained[0]}
    # the average moves only after the run's steps 2 and 5: the last of iteration 0 and the first of
    # iteration 2, whose weights no checkpoint holds — so check it at iteration 0 and 1 exactly
    want0 = reference_average(base, [trained[0], trained[0]], EVERY, DECAY)  # step 1 does not move it
    assert all(torch.equal(average[0][k], want0[k]) for k in want0)
    assert all(torch.equal(average[1][k], average[0][k]) for k in want0), "step 3 and 4 moved the average"
    assert any(not torch.equal(average[2][k], average[1][k]) for k in want0), "step 5 did not move it"
    assert any(not torch.equal(average[0][k], trained[0][k]) for k in want0)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    gap = client.get_metric_history(out["run_id"], "ema/relative_gap")
    assert len(gap) == 3 and all(m.value > 0 for m in gap)


def test_a_replayed_update_reproduces_the_average_bit_for_bit(ema_run):
    wd, _, _ = ema_run
    for it in (1, 2):  # from a checkpoint's average and its step count; moved (2) and not (1)
        res = _ok(["replay", "E", "--iteration", str(it), "--workdir", str(wd)])
        report = json.loads(res.stdout.strip().splitlines()[-1])
        assert report["equal"] and report["tensors"] == 2 * len(load_file(str(ema_run[2][0] / EMA)))


def test_evaluation_uses_the_average(ema_run):
    from mlflow.tracking import MlflowClient

    from pixrl.engines.local import LocalEngine

    wd, out, cks = ema_run
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    steps = lambda key: sorted(m.step for m in client.get_metric_history(out["run_id"], key))  # noqa: E731
    assert steps("heldout/accuracy") == [0, 3] and steps("heldout_trained/accuracy") == [3]  # the base has one
    cfg = ExperimentConfig.model_validate(json.loads((cks[-1] / "config.json").read_text()))
    counters = json.loads((cks[-1] / "counters.json").read_text())
    source = evaluated_weights(PolicySource(cks[-1], counters["checkpoint_id"]))
    assert source.ema
    engine = LocalEngine(cfg)
    engine.evaluate(source, "shapes", "heldout", 1)
    average = load_file(str(cks[-1] / EMA))
    state = engine.policy.state()
    assert all(torch.equal(state[k], average[k].to(state[k].dtype)) for k in average)
    engine.use(PolicySource(cks[-1], counters["checkpoint_id"]))  # a rollout of the version: its trained weights
    trained = load_file(str(cks[-1] / "trainable.safetensors"))
    assert all(torch.equal(engine.policy.state()[k], trained[k]) for k in trained)


def test_eval_generate_and_export_take_the_average_unless_told(ema_run, tmp_path):
    wd, _, cks = ema_run
    res = _ok(["export-model", "--run", "E", "--workdir", str(wd), "--out", str(tmp_path / "avg")])
    assert json.loads(res.stdout.strip().splitlines()[-1])["source"]["weights"] == "average"
    res = _ok(["export-model", "--run", "E", "--workdir", str(wd), "--out", str(tmp_path / "raw"),
               "--weights", "trained"])
    assert json.loads(res.stdout.strip().splitlines()[-1])["source"]["weights"] == "trained"
    tensors = lambda d: load_file(str(d / "transformer" / "diffusion_pytorch_model.safetensors"))  # noqa: E731
    avg, raw = tensors(tmp_path / "avg"), tensors(tmp_path / "raw")
    average, trained = load_file(str(cks[-1] / EMA)), load_file(str(cks[-1] / "trainable.safetensors"))
    assert all(torch.equal(avg[k], average[k].to(avg[k].dtype)) for k in average)
    assert all(torch.equal(raw[k], trained[k]) for k in trained)
    for weights in ("average", "trained"):
        _ok(["generate", "--prompt", "a red circle", "--out", str(tmp_path / weights), "--run", "E",
             "--workdir", str(wd), "--steps", "2", "--weights", weights])
    res = CliRunner().invoke(app, ["eval", "--run", "E", "--workdir", str(wd), "--weights", "mean"])
    assert res.exit_code == 2 and "--weights must be one of average, trained" in res.output


def test_asking_for_the_average_of_a_checkpoint_without_one_names_the_fix(tiny_checkpoint, tmp_path, prefect_harness):
    _ok(["train", "-n", "1", "--run", "N", "reward=jpeg_compressibility", *tiny_overrides(tiny_checkpoint, tmp_path)])
    ck = next((tmp_path / "checkpoints" / "N").glob("*/it_0000"))
    assert not (ck / EMA).exists()
    assert not evaluated_weights(PolicySource(ck, "x")).ema  # evaluated as its trained weights
    res = CliRunner().invoke(app, ["eval", "--checkpoint", str(ck), "--weights", "average", "--per-category", "1"])
    assert res.exit_code == 2 and "holds no weight average" in res.output and "algorithm.ema.enabled" in res.output
    assert issubclass(MissingEma, FileNotFoundError)


def test_a_run_resumed_after_a_failed_update_holds_the_uninterrupted_average(ema_run, tiny_checkpoint, tmp_path,
                                                                           monkeypatch):
    """Iteration 2's update fails after its work, before its commit; `pixrl resume` redoes it from
    iteration 1's checkpoint — weights, moments and the average with its step count."""
    from pixrl.stages.chaos import ENV

    wd, _, cks = ema_run
    args = ["train", "-n", "3", "--run", "E", "--seed", "5", "reward=jpeg_compressibility",
            "algorithm.ema.enabled=true", f"algorithm.ema.every={EVERY}", f"algorithm.ema.decay={DECAY}",
            "algorithm.optimizer_steps_per_iteration=2",
            *tiny_overrides(tiny_checkpoint, tmp_path, **{"run.eval_every": 3, "run.eval_per_category": 1})]
    monkeypatch.setenv(ENV, "update@2:raise")
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1 and "injected fault in update" in res.output
    monkeypatch.delenv(ENV)
    out = json.loads(_ok(["resume", "E", "--workdir", str(tmp_path)]).stdout.strip().splitlines()[-1])
    resumed = next((tmp_path / "checkpoints" / "E" / out["run_id"]).glob("it_0002"))
    for name in ("trainable.safetensors", EMA):
        want, got = load_file(str(cks[-1] / name)), load_file(str(resumed / name))
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), name
    assert _steps(resumed) == 6
