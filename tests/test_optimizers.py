"""algorithm.optimizer and algorithm.lr_warmup_steps: the schedule is transformers'
constant_with_warmup step for step; Adafactor is DiffusionDPO's (factored state, its settings);
a run with both continues its schedule across checkpoints (a replay in a fresh engine recomputes
the update bit for bit), and a checkpoint of another optimizer is refused by name."""

import json

import pytest
import torch
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.artifacts.checkpoints import load_optimizer_state
from pixrl.artifacts.tracking import Tracker
from pixrl.cli import app
from pixrl.config.schema import AlgorithmConfig, ExperimentConfig
from pixrl.engines.optimizers import (OPTIMIZER_NAME, OPTIMIZER_STEPS, OptimizerMismatch, build_optimizer,
                                      learning_rate, saved_state, split_saved_state)
from pixrl.run import run_spec
from pixrl.stages.lineage import replay_update


def test_the_schedule_is_transformers_constant_with_warmup():
    from transformers import get_constant_schedule_with_warmup

    algo = AlgorithmConfig(lr=2.048e-5, lr_warmup_steps=7)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=algo.lr)
    sched = get_constant_schedule_with_warmup(opt, num_warmup_steps=7)
    for step in range(12):  # the lr each optimizer step runs with, then the scheduler's step after it
        assert learning_rate(algo, step) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=0)
        opt.step()
        sched.step()
    assert learning_rate(AlgorithmConfig(lr=1e-3), 0) == 1e-3  # no warmup: constant from the first step


def test_adafactor_is_diffusiondpo_s_and_keeps_factored_state():
    from transformers.optimization import Adafactor

    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 32)
    algo = AlgorithmConfig(optimizer="adafactor", lr=1e-3, weight_decay=1e-2)
    ours = build_optimizer(list(layer.parameters()), algo)
    twin = torch.nn.Linear(48, 32)
    twin.load_state_dict(layer.state_dict())
    theirs = Adafactor(twin.parameters(), lr=1e-3, weight_decay=1e-2, clip_threshold=1.0, scale_parameter=False,
                       relative_step=False)  # DiffusionDPO's train.py for SDXL
    x = torch.randn(8, 48)
    for model, opt in ((layer, ours), (twin, theirs)):
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(layer.parameters(), twin.parameters()))
    state = ours.state[layer.weight]
    assert state["exp_avg_sq_row"].shape == (32,) and state["exp_avg_sq_col"].shape == (48,)
    assert "exp_avg" not in state  # no first moment: beta1 None
    adamw = build_optimizer([torch.nn.Parameter(torch.zeros(3))], AlgorithmConfig())
    assert isinstance(adamw, torch.optim.AdamW)


def test_saved_state_round_trip_and_refusal():
    algo = AlgorithmConfig(optimizer="adafactor")
    state, steps = split_saved_state(saved_state({"state": {}, "param_groups": []}, algo, 9), algo)
    assert steps == 9 and OPTIMIZER_NAME not in state and OPTIMIZER_STEPS not in state
    with pytest.raises(OptimizerMismatch, match="continue it with algorithm.optimizer=adafactor"):
        split_saved_state(saved_state({"state": {}, "param_groups": []}, algo, 9), AlgorithmConfig())
    legacy = {"state": {0: {"step": torch.tensor(6.0)}}, "param_groups": []}  # written before the keys existed
    assert split_saved_state(legacy, AlgorithmConfig())[1] == 6


def test_adafactor_is_refused_with_fsdp():
    with pytest.raises(ValueError, match="algorithm.optimizer=adafactor keeps factored moments"):
        ExperimentConfig.model_validate({"algorithm": {"optimizer": "adafactor"}, "run": {"engine": "ray"},
                                         "ray": {"trainer_sharding": "fsdp"}})


def test_a_run_continues_its_schedule_across_checkpoints(tiny_checkpoint, tmp_path, prefect_harness):
    """Adafactor with 3 warmup steps: each update's steps continue the run's count (its last step's
    lr is logged). A replay of iteration 1 loads iteration 0's checkpoint in a fresh engine, so it
    equals the recorded checkpoint only if the step count came back from there."""
    lr = 3e-4
    res = CliRunner().invoke(app, ["train", "-n", "2", "--run", "ada", "--seed", "5", "reward=jpeg_compressibility",
                                   *tiny_overrides(tiny_checkpoint, tmp_path), "algorithm.optimizer=adafactor",
                                   f"algorithm.lr={lr}", "algorithm.lr_warmup_steps=3"])
    assert res.exit_code == 0, res.output
    run_id = json.loads(res.stdout.strip().splitlines()[-1])["run_id"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    steps = [int(m.value) for m in sorted(client.get_metric_history(run_id, "optimizer_steps"), key=lambda m: m.step)]
    lrs = [m.value for m in sorted(client.get_metric_history(run_id, "lr"), key=lambda m: m.step)]
    assert lrs == [pytest.approx(lr * min(1.0, (steps[0] - 1) / 3)), pytest.approx(lr * min(1.0, (sum(steps) - 1) / 3))]
    saved = load_optimizer_state(tmp_path / "checkpoints" / "ada" / run_id / "it_0001")
    assert saved[OPTIMIZER_NAME] == "adafactor" and saved[OPTIMIZER_STEPS] == sum(steps)
    assert any("exp_avg_sq_row" in s for s in saved["state"].values())
    rep = CliRunner().invoke(app, ["replay", "ada", "--iteration", "1", "--workdir", str(tmp_path)])
    assert rep.exit_code == 0, rep.output
    assert json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True
    cfg = ExperimentConfig.model_validate(Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}").read_config(run_id))
    cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"optimizer": "adamw"})})
    with pytest.raises(OptimizerMismatch, match="optimizer state is adafactor's"):
        replay_update(run_spec(cfg, tmp_path, run_id), 1)
