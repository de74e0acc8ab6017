"""DiffusionOPD: a term is VeRL-Omni's `distill_kl` (DistillKLLoss.compute_loss written out) on the
student's stored SDE transitions against the frozen teacher's step from the same state; with
policy_gradient it is Flow-GRPO's term plus the weighted KL; a step moves the student toward the
teacher. Through the real flow: the teacher is a registered version another run published,
checked before any work, never trained, and an interrupted run resumes bit for bit."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.replay import ReplayPolicy
from pixrl.algorithms.sampling import SamplerRecipe, generators, replay_step, sample
from pixrl.config.schema import AlgorithmConfig, SamplingConfig
from pixrl.engines.stored_policies import check_same_tensors
from pixrl.models.sd3 import SD3Family

PROMPTS = ["a red circle", "a red circle", "two blue squares", "two blue squares"]
RECIPE = SamplerRecipe(4, 0.7, "sde", 1.0, (0, 1), (0, 1))


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    """(student, teacher): the tiny SD3 and a copy with its transformer's weights moved."""
    student = SD3Family.load(tiny_checkpoint, max_sequence_length=0)
    teacher = copy.copy(student)
    teacher.transformer = copy.deepcopy(student.transformer)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in teacher.transformer.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    student.transformer.requires_grad_(True)
    return student, teacher


def _rollout(student):
    cond = student.encode_prompts(PROMPTS)
    with torch.no_grad():
        traj = sample(student, cond, None, generators([1, 2, 3, 4]), RECIPE)
    batch = {"latents": traj.latents.numpy(), "next_latents": traj.next_latents.numpy(),
             "log_probs": traj.log_probs.numpy(), "stored_steps": np.tile(np.array(traj.stored_steps, np.int32), (4, 1)),
             "advantage": np.array([1.0, -1.0, 0.5, -0.5], np.float32), "sample_id": ["a", "b", "c", "d"]}
    return cond, traj, batch


def _terms(name, student, frozen, cond, traj, batch, **settings):
    algo = build_algorithm(AlgorithmConfig(name=name, **settings))
    policy = ReplayPolicy(student, None, cond, None, traj.sigmas, traj.timesteps, RECIPE, torch.device("cpu"),
                          frozen={"teacher": frozen} if frozen is not None else {})
    return list(algo.losses(batch, policy))


def _distill_kl(student, teacher, cond, traj, batch, j):
    """VeRL-Omni's DistillKLLoss.compute_loss: ((μ − μ_T)²).mean(dims) / (2·std_dev_t²), then the mean."""
    x, x_next = torch.from_numpy(batch["latents"][:, j]), torch.from_numpy(batch["next_latents"][:, j])
    k = int(batch["stored_steps"][0, j])
    out = replay_step(student, x, x_next, k, traj.sigmas, traj.timesteps, cond, None, RECIPE, None)
    with torch.no_grad():
        tea = replay_step(teacher, x, x_next, k, traj.sigmas, traj.timesteps, cond, None, RECIPE, None)
    std = out.std_dev_t.reshape(-1, 1, 1, 1).float()
    return (((out.mean - tea.mean) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std**2)).mean()


def test_a_term_is_verl_omnis_distill_kl_in_value_and_gradient(pair):
    student, teacher = pair
    cond, traj, batch = _rollout(student)
    terms = _terms("diffusion_opd", student, teacher, cond, traj, batch, teacher="models:/t-policy/1", distill_coef=0.5)
    assert len(terms) == 2  # one per stored SDE transition
    params = [p for p in student.transformer.parameters()]
    for j, (loss, metrics) in enumerate(terms):
        want = _distill_kl(student, teacher, cond, traj, batch, j)
        assert torch.allclose(loss, 0.5 * want, rtol=1e-6, atol=1e-9) and float(want.detach()) > 0
        assert torch.allclose(metrics["distill_kl"], want.detach(), rtol=1e-6)
        got = torch.autograd.grad(loss, params, allow_unused=True)
        ref = torch.autograd.grad(0.5 * _distill_kl(student, teacher, cond, traj, batch, j), params, allow_unused=True)
        assert all((a is None and b is None) or torch.allclose(a, b, rtol=1e-5, atol=1e-10) for a, b in zip(got, ref))


def test_with_policy_gradient_a_term_adds_the_weighted_kl_to_flow_grpos(pair):
    student, teacher = pair
    cond, traj, batch = _rollout(student)
    with torch.no_grad():
        both = _terms("diffusion_opd", student, teacher, cond, traj, batch, teacher="models:/t-policy/1",
                      distill_coef=2.0, policy_gradient=True, clip_range=0.2)
        grpo = _terms("flow_grpo", student, None, cond, traj, batch, clip_range=0.2)
    for j, ((loss, m), (pg, _)) in enumerate(zip(both, grpo)):
        kl = _distill_kl(student, teacher, cond, traj, batch, j).detach()
        assert torch.allclose(loss, pg + 2.0 * kl, rtol=1e-6) and "clipfrac" in m


def test_several_teachers_each_take_the_rows_of_their_task(pair):
    """Multi-teacher (MOPD): each row's transition is distilled toward the teacher its prompt's task
    routes to — the term's KL is the mean of each row's KL under its own teacher, each teacher
    stepping only its rows; 'default' takes the tasks no key names; unknown tasks are refused."""
    student, teacher = pair
    other = copy.copy(teacher)
    other.transformer = copy.deepcopy(teacher.transformer)
    with torch.no_grad():
        for p in other.transformer.parameters():
            p.mul_(-1.0)
    cond, traj, batch = _rollout(student)
    batch["prompt_meta"] = np.array([json.dumps({"category": c}) for c in ("ocr", "aes", "aes", "ocr")])
    routed = {"ocr": teacher, "aes": other}
    algo = build_algorithm(AlgorithmConfig(name="diffusion_opd", teachers={"ocr": "models:/t/1", "aes": "models:/t/2"}))
    assert set(algo.stored_policies()) == set(algo.frozen_slots()) == {"teacher:ocr", "teacher:aes"}
    assert "prompt_meta" in algo.needs
    policy = ReplayPolicy(student, None, cond, None, traj.sigmas, traj.timesteps, RECIPE, torch.device("cpu"),
                          frozen={f"teacher:{k}": v for k, v in routed.items()})
    for j, (loss, metrics) in enumerate(algo.losses(batch, policy)):
        rows = []
        for i, task in enumerate(("ocr", "aes", "aes", "ocr")):
            one = {k: v[i:i + 1] for k, v in batch.items() if k != "sample_id"}
            rows.append(_distill_kl(student, routed[task], cond.select([i]), traj, one, j))
        want = torch.stack(rows).mean()
        assert torch.allclose(metrics["distill_kl"], want.detach(), rtol=1e-5), (metrics["distill_kl"], want)
        mixed = _distill_kl(student, teacher, cond, traj, batch, j).detach()  # one teacher for all: another value
        assert not torch.allclose(metrics["distill_kl"], mixed, rtol=1e-3)
    fallback = build_algorithm(AlgorithmConfig(name="diffusion_opd", teachers={"ocr": "models:/t/1", "default": "models:/t/2"}))
    assert fallback.routes(batch["prompt_meta"]) == ["teacher:ocr", "teacher:default", "teacher:default", "teacher:ocr"]
    fallback.check_prompt_meta([{"category": "anything"}])
    with pytest.raises(ValueError, match="no teacher for the prompts whose 'category' is 'geneval'.*keys: aes, ocr"):
        algo.check_prompt_meta([{"category": "ocr"}, {"category": "geneval"}])
    with pytest.raises(ValueError, match="teacher and algorithm.teachers both set"):
        build_algorithm(AlgorithmConfig(name="diffusion_opd", teacher="models:/t/1",
                                        teachers={"a": "models:/t/2"})).check_family(None)
    with pytest.raises(ValueError, match="expected models:/NAME/VERSION"):
        build_algorithm(AlgorithmConfig(name="diffusion_opd", teachers={"a": "models:/t"})).check_family(None)


def test_no_distance_to_itself_and_a_step_moves_the_student_toward_the_teacher(pair, tiny_checkpoint):
    student, teacher = pair
    cond, traj, batch = _rollout(student)
    with torch.no_grad():
        same = _terms("diffusion_opd", student, student, cond, traj, batch, teacher="models:/t-policy/1")
    assert all(float(loss) == 0 for loss, _ in same)
    moved = copy.copy(student)
    moved.transformer = copy.deepcopy(student.transformer)
    opt = torch.optim.SGD(moved.transformer.parameters(), lr=0.5)
    with torch.no_grad():
        before = sum(float(_distill_kl(moved, teacher, cond, traj, batch, j)) for j in range(2))
    for loss, _ in _terms("diffusion_opd", moved, teacher, cond, traj, batch, teacher="models:/t-policy/1"):
        loss.backward()
    opt.step()
    with torch.no_grad():
        after = sum(float(_distill_kl(moved, teacher, cond, traj, batch, j)) for j in range(2))
    assert after < before


def test_every_sample_trains_and_settings_it_cannot_use_are_refused():
    from pixrl.config.loader import ConfigError

    algo = build_algorithm(AlgorithmConfig(name="diffusion_opd", teacher="models:/t-policy/2"))
    assert algo.trains_on(np.zeros(4), np.array([0, 0, 1, 1])).all()  # flat groups still distil
    assert algo.stored_policies() == {"teacher": "models:/t-policy/2"} and algo.frozen_slots() == ("teacher",)
    pg = build_algorithm(AlgorithmConfig(name="diffusion_opd", teacher="models:/t-policy/2", policy_gradient=True))
    assert pg.trains_on(np.array([0.0, 1.0]), np.array([0, 0])).tolist() == [False, True]
    assert algo.frozen_weights("teacher", {}) is None  # the engine fills the slot from the stored policy
    with pytest.raises(TypeError, match="no frozen policy 'anchor'"):
        algo.frozen_weights("anchor", {})
    with pytest.raises(ValueError, match="set algorithm.teacher=models:/NAME/VERSION"):
        build_algorithm(AlgorithmConfig(name="diffusion_opd")).check_family(SD3Family)
    with pytest.raises(ValueError, match="expected models:/NAME/VERSION"):
        build_algorithm(AlgorithmConfig(name="diffusion_opd", teacher="models:/x")).check_family(SD3Family)
    with pytest.raises(ConfigError, match="algorithm.distill_coef"):
        build_algorithm(AlgorithmConfig(name="diffusion_opd", teacher="models:/x/1", distill_coef=0))
    with pytest.raises(ValueError, match="denoise"):
        algo.check_sampling(SamplingConfig(), "token")


def test_a_teacher_of_other_tensors_is_refused_naming_them():
    mine = {"a.lora_A": torch.zeros(4, 8), "a.lora_B": torch.zeros(8, 4)}
    check_same_tensors({k: v.clone() for k, v in mine.items()}, mine, "teacher models:/t/1")
    with pytest.raises(ValueError, match=r"2 of other shapes \(e.g. a.lora_A: \(2, 8\) vs \(4, 8\)\).*lora settings"):
        check_same_tensors({"a.lora_A": torch.zeros(2, 8), "a.lora_B": torch.zeros(8, 2)}, mine, "teacher")
    with pytest.raises(ValueError, match="2 of this policy's 2 trained tensors absent.*1 it does not train"):
        check_same_tensors({"a.weight": torch.zeros(8, 8)}, mine, "teacher")


# --- through the real flow -------------------------------------------------------------------------
def _train(ckpt, wd, run, config, *extra, iterations=2):
    from typer.testing import CliRunner

    from conftest import tiny_overrides
    from pixrl.cli import app

    return CliRunner().invoke(app, ["train", "--iterations", str(iterations), "--run", run, "--config", config,
                                    "reward=jpeg_compressibility", *tiny_overrides(ckpt, wd), *extra])


def test_a_student_distils_a_published_teacher_and_resumes_bit_for_bit(tiny_checkpoint, tmp_path, monkeypatch,
                                                                       prefect_harness):
    import hashlib

    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from conftest import fault_then_resume
    from pixrl.cli import app

    wd = tmp_path / "wd"
    res = _train(tiny_checkpoint, wd, "T", "shapes_flow_grpo", iterations=1)  # the teacher: one published version
    assert res.exit_code == 0, res.output
    model = json.loads(res.stdout.strip().splitlines()[-1])["model_name"]
    (teacher_ck,) = (wd / "checkpoints" / "T").glob("*/it_0000")
    digest = hashlib.sha256((teacher_ck / "trainable.safetensors").read_bytes()).hexdigest()

    for extra, said in ((["algorithm.lora.enabled=true"], "was trained with algorithm.lora.enabled=False; this run "
                                                          "has algorithm.lora.enabled=True"),
                        ([f"algorithm.teacher=models:/{model}/9"], "no such version"),
                        (["algorithm.teacher=null"], "set algorithm.teacher=models:/NAME/VERSION")):
        args = [f"algorithm.teacher=models:/{model}/1", *extra]
        bad = _train(tiny_checkpoint, wd, "bad", "shapes_diffusion_opd", *args)
        assert bad.exit_code != 0 and said in " ".join(bad.output.split()), bad.output
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    assert not client.search_runs([e.experiment_id for e in client.search_experiments()], "attributes.run_name = 'bad'")

    res = _train(tiny_checkpoint, wd, "S", "shapes_diffusion_opd", f"algorithm.teacher=models:/{model}/1")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    hist = client.get_metric_history(out["run_id"], "distill_kl")
    assert len(hist) == 2 and all(h.value > 0 for h in hist)
    assert "clipfrac" not in client.get_run(out["run_id"]).data.metrics  # distillation alone: no PPO term
    assert sorted(int(v.version) for v in client.search_model_versions(f"name='{model}'")) == [1, 2, 3]
    (final,) = (wd / "checkpoints" / "S").glob("*/it_0001")
    weights, teacher_w = load_file(str(final / "trainable.safetensors")), load_file(str(teacher_ck / "trainable.safetensors"))
    base = load_file(str(tiny_checkpoint / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert set(weights) == set(teacher_w) and any(not torch.equal(weights[k], base[k]) for k in base if k in weights)
    assert hashlib.sha256((teacher_ck / "trainable.safetensors").read_bytes()).hexdigest() == digest  # untouched

    _several_teachers_by_category(tiny_checkpoint, wd, client, model)
    _a_directory_teacher_is_the_same_teacher(tiny_checkpoint, wd, teacher_ck, weights)
    rep = CliRunner().invoke(app, ["replay", "S", "--iteration", "1", "--workdir", str(wd)])
    assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output
    fault_then_resume(monkeypatch, lambda: _train(tiny_checkpoint, wd, "A", "shapes_diffusion_opd",
                                                  f"algorithm.teacher=models:/{model}/1"), wd, "A")
    (resumed,) = (wd / "checkpoints" / "A").glob("*/it_0001")
    again = load_file(str(resumed / "trainable.safetensors"))
    assert all(again[k].equal(weights[k]) for k in weights), "resumed weights differ"


def _a_directory_teacher_is_the_same_teacher(tiny_checkpoint, wd, teacher_ck, weights):
    """The teacher's version exported as a merged diffusers pipeline (`pixrl export-model --merge`):
    a student distilling the directory ends bit for bit where the one distilling the version did;
    a LoRA student distils it too (a module of its own beside the adapter); a directory of
    another architecture, or none, is refused before any work."""
    import shutil

    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from pixrl.cli import app

    merged = wd.parent / "merged"
    res = CliRunner().invoke(app, ["export-model", "--checkpoint", str(teacher_ck), "--out", str(merged), "--merge",
                                   "--link"])
    assert res.exit_code == 0, res.output
    res = _train(tiny_checkpoint, wd, "D", "shapes_diffusion_opd", f"algorithm.teacher={merged}")
    assert res.exit_code == 0, res.output
    (final,) = (wd / "checkpoints" / "D").glob("*/it_0001")
    got = load_file(str(final / "trainable.safetensors"))
    assert all(got[k].equal(weights[k]) for k in weights), "a directory teacher trained otherwise than its version"
    res = _train(tiny_checkpoint, wd, "L", "shapes_diffusion_opd", f"algorithm.teacher={merged}",
                 "algorithm.lora.enabled=true", "algorithm.lora.rank=4", "algorithm.lora.alpha=8", iterations=1)
    assert res.exit_code == 0, res.output

    other = wd.parent / "other"
    shutil.copytree(merged / "transformer", other, symlinks=True)
    conf = json.loads((other / "config.json").read_text())
    (other / "config.json").unlink()
    (other / "config.json").write_text(json.dumps({**conf, "num_layers": conf["num_layers"] + 1}))
    for teacher, said in ((other, "is another architecture than this run's model: num_layers="),
                          (wd.parent / "nowhere", "neither a pixrl checkpoint")):
        bad = _train(tiny_checkpoint, wd, "bad2", "shapes_diffusion_opd", f"algorithm.teacher={teacher}")
        assert bad.exit_code != 0 and said in " ".join(bad.output.split()), bad.output


def _several_teachers_by_category(tiny_checkpoint, wd, client, model):
    """Multi-teacher through the flow: a teacher per category (two registered versions, 'default' for the
    rest) distils; a task with no teacher is refused before any run, naming the categories."""
    teachers = [f"algorithm.teachers.position=models:/{model}/1", f"algorithm.teachers.color_attr=models:/{model}/2"]
    bad = _train(tiny_checkpoint, wd, "bad3", "shapes_diffusion_opd", *teachers)
    said = "no teacher for the prompts whose 'category' is 'colors', 'counting', 'two_object' (its keys: color_attr, position)"
    assert bad.exit_code != 0 and said in " ".join(bad.output.split()), bad.output
    assert not client.search_runs([e.experiment_id for e in client.search_experiments()], "attributes.run_name = 'bad3'")
    res = _train(tiny_checkpoint, wd, "M", "shapes_diffusion_opd", *teachers, f"algorithm.teachers.default=models:/{model}/2",
                 iterations=1)
    assert res.exit_code == 0, res.output
    hist = client.get_metric_history(json.loads(res.stdout.strip().splitlines()[-1])["run_id"], "distill_kl")
    assert len(hist) == 1 and hist[0].value > 0
