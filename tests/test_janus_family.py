"""The Janus-Pro family (token-autoregressive) on a tiny random checkpoint written by `pixrl tiny
janus_pro` in the transformers layout: prompts as JanusProcessor formats them, sampling equal to
JanusForConditionalGeneration.generate (tokens, logits, decoded image) with guidance, temperature
and top-k, rollout → replay log-probs exactly equal, clear errors for bad checkpoints and prompts,
and two Token-GRPO iterations through the unchanged flow (LoRA and full fine-tuning)."""

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import tiny_overrides, two_iterations
from pixrl.algorithms.token_sampling import TokenRecipe, sample_tokens, sequence_log_probs
from pixrl.models.base import ModelLoadError
from pixrl.models.janus import JanusProFamily, PromptTooLong
from pixrl.models.registry import get_family

PROMPTS = ["a red circle", "two blue squares on the left of a green triangle", "a cat"]  # left padding


@pytest.fixture(scope="module")
def family(tiny_janus):
    return JanusProFamily.load(tiny_janus[0])


@pytest.fixture(scope="module")
def reference(tiny_janus):
    from transformers import JanusForConditionalGeneration, JanusProcessor

    path = str(tiny_janus[0])
    return JanusForConditionalGeneration.from_pretrained(path).eval(), JanusProcessor.from_pretrained(path)


def test_registered_as_a_token_policy(family):
    assert get_family("janus_pro") is JanusProFamily
    sem = family.semantics
    assert (sem.regime.value, sem.step.value, sem.action.value) == ("token_autoregressive", "token", "categorical")
    assert family.image_token_count() == 16 and family.resolution == 16
    assert family.lora_targets and all(t.startswith("model.language_model.") for t in family.lora_targets)


def test_prompts_are_formatted_as_the_processor_does_for_image_generation(family, reference):
    _, proc = reference
    cond = family.encode_prompts(PROMPTS)
    for i, p in enumerate(PROMPTS):
        text = proc.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": p}]}],
                                        add_generation_prompt=True)
        want = proc(text=text, generation_mode="image", return_tensors="pt").input_ids[0].tolist()
        row = cond.ids[i][cond.mask[i].bool()].tolist()
        assert row == want
        unc = cond.uncond_ids[i][cond.mask[i].bool()].tolist()  # all but BOS and <begin_of_image> padded
        assert unc[0] == want[0] and unc[-1] == want[-1] and set(unc[1:-1]) == {family.pad_id}


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
def test_sampling_equals_transformers_generate(family, reference, temperature, top_k):
    """Same prompt, seed and guidance: the same tokens, the same raw logits of the last step and
    the same decoded image as JanusForConditionalGeneration.generate + the processor's postprocess."""
    model, proc = reference
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": PROMPTS[0]}]}],
                                    add_generation_prompt=True)
    inputs = proc(text=text, generation_mode="image", return_tensors="pt")
    torch.manual_seed(11)
    out = model.generate(**inputs, generation_mode="image", do_sample=True, guidance_scale=5.0,
                         temperature=temperature, top_k=top_k or None, return_dict_in_generate=True, output_scores=True)
    recipe = TokenRecipe(5.0, temperature, top_k)
    cond = family.encode_prompts(PROMPTS[:1])
    traj = sample_tokens(family, cond, [torch.Generator().manual_seed(11)], recipe)
    assert traj.tokens.tolist() == out.sequences.tolist()
    with torch.no_grad():
        logits = family.sequence_logits(cond, traj.tokens, guided=True)[:, -1]  # [cond; uncond] raw
    torch.testing.assert_close(logits, out.scores, atol=1e-5, rtol=1e-5)
    ref = proc.postprocess(list(model.decode_image_tokens(out.sequences).float().permute(0, 3, 1, 2)),
                           return_tensors="np")["pixel_values"]
    assert np.array_equal(family.decode(traj.tokens), np.asarray(ref).transpose(0, 2, 3, 1))


def test_replay_reproduces_the_stored_log_probs_exactly(family):
    """With guidance, a batch of prompts of different lengths, fp32 CPU: the teacher-forced replay
    (with gradients) gives the stored log-probs bit for bit; the incremental sampler's own
    log-probs agree to float precision."""
    recipe = TokenRecipe(5.0, 0.9, 20)
    cond = family.encode_prompts(PROMPTS)
    traj = sample_tokens(family, cond, [torch.Generator().manual_seed(s) for s in (1, 2, 3)], recipe)
    family.model.requires_grad_(True)
    try:
        new, entropy = sequence_log_probs(family, cond, traj.tokens, recipe)
        assert new.requires_grad
        assert torch.equal(new.detach(), traj.log_probs)
        assert float(torch.exp(new.detach() - traj.log_probs).max()) == 1.0
    finally:
        family.model.requires_grad_(False)
    assert float((traj.log_probs - traj.sampler_log_probs).abs().max()) < 1e-4
    assert bool((entropy > 0).all()) and float(entropy.max()) <= np.log(20) + 1e-5  # top-20 support


def test_seeded_samples_do_not_depend_on_their_batch(family):
    recipe = TokenRecipe(3.0)
    both = sample_tokens(family, family.encode_prompts(PROMPTS[:2]),
                         [torch.Generator().manual_seed(s) for s in (5, 6)], recipe)
    alone = sample_tokens(family, family.encode_prompts(PROMPTS[1:2]), [torch.Generator().manual_seed(6)], recipe)
    assert both.tokens[1].tolist() == alone.tokens[0].tolist()


def test_a_checkpoint_without_the_generation_head_is_refused(tiny_janus, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_janus[0]
    bad = tmp_path / "understanding-only"
    shutil.copytree(src, bad)
    weights = load_file(str(bad / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if "generation_head" not in k}, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="no image-generation head"):
        JanusProFamily.load(bad)
    cfg = json.loads((src / "config.json").read_text())
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**cfg["text_config"], "model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="not a Janus"):
        JanusProFamily.load(other)
    with pytest.raises(ModelLoadError, match="makes images"):
        JanusProFamily.load(src, frames=5)
    with pytest.raises(ModelLoadError, match="generates 16px"):
        JanusProFamily.load(src, resolution=64)
    with pytest.raises(ModelLoadError, match="model.height=16, model.width=32: .* 16px square"):
        JanusProFamily.load(src, resolution=(16, 32))


def test_a_prompt_longer_than_the_context_is_refused(family, tiny_janus):
    long = " ".join(["red circle"] * 200)
    with pytest.raises(PromptTooLong, match="shorten the prompt"):
        family.encode_prompts([long])
    with pytest.raises(PromptTooLong, match="context of 256 positions minus 16 image tokens"):
        JanusProFamily.check_prompts(tiny_janus[0], ["a cat", long])


def test_bad_runs_fail_before_any_work(tiny_janus, tmp_path):
    """Preflight: a prompt set with a prompt longer than the context, a negative guidance weight,
    a denoise algorithm on a token family — each named, nothing written."""
    from typer.testing import CliRunner

    from pixrl.cli import app

    path, _ = tiny_janus
    base = ["train", "--iterations", "1", "model.family=janus_pro", "algorithm=token_grpo",
            "reward=jpeg_compressibility", *tiny_overrides(path, tmp_path)]
    cases = [(["model.max_sequence_length=6"], "shorten the prompt"),
             (["sampling.guidance_scale=-2"], "guidance_scale"),
             (["algorithm=flow_grpo"], "do not store")]
    for extra, message in cases:
        res = CliRunner().invoke(app, [*base, *extra])
        assert res.exit_code != 0 and message in res.output, res.output
    assert not (tmp_path / "lance").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_token_grpo_iterations_through_the_flow(tiny_janus, tmp_path, prefect_harness, mode):
    out, t = two_iterations(tiny_janus, tmp_path, f"janus-{mode}", mode, "algorithm.lr=1e-3",
                            algorithm="token_grpo", base_weights="model.safetensors")
    assert set(t["step_kind"].to_pylist()) == {"token"} and "latents" not in t.column_names
    tokens = np.stack(t["tokens"].to_numpy(zero_copy_only=False))
    assert tokens.shape == (16, 16) and tokens.min() >= 0 and tokens.max() < 64
    recipe = json.loads(t["recipe"][0].as_py())
    assert (recipe["sampler"], recipe["guidance_scale"], recipe["image_tokens"]) == ("token", 5.0, 16)
    assert all(np.isfinite(np.stack(t["log_probs"].to_numpy(zero_copy_only=False))).ravel())


def test_token_dpo_and_sft_from_the_archive(tiny_janus, tmp_path, prefect_harness):
    """`pixrl dpo` over a token run's archived groups: sequence-log-prob DPO (ln 2 at the
    reference), a registered version tagged with its algorithm, held-out before/after; then SFT on
    the winners of the same pairs (the mean token NLL, no reference)."""
    import math

    from mlflow.tracking import MlflowClient
    from typer.testing import CliRunner

    from pixrl.cli import app

    two_iterations(tiny_janus, tmp_path, "jsrc", "full", "algorithm.lr=1e-3", algorithm="token_grpo",
                   base_weights="model.safetensors")
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")

    def offline(run: str, algorithm: str):
        res = CliRunner().invoke(app, ["dpo", "--from", "jsrc", "-n", "3", "--run", run, "--workdir", str(tmp_path),
                                       "model.family=janus_pro", f"model.path={tiny_janus[0]}",
                                       f"algorithm={algorithm}", "algorithm.lr=1e-3", "sampling.guidance_scale=5",
                                       "dpo.eval_per_category=1", "dpo.pairs_per_step=2"])
        assert res.exit_code == 0, res.output + repr(res.exception)
        out = json.loads(res.stdout.strip().splitlines()[-1])
        run_info = client.get_run(out["run_id"])
        assert run_info.data.tags["pixrl.algorithm"] == algorithm
        loss = sorted(client.get_metric_history(out["run_id"], "dpo/loss"), key=lambda m: m.step)
        return out, run_info, loss

    out, run, loss = offline("jdpo", "token_dpo")
    assert len(loss) == 3 and loss[0].value == pytest.approx(math.log(2), abs=1e-6)
    assert "heldout/accuracy_before" in run.data.metrics and "heldout/accuracy" in run.data.metrics
    assert client.get_model_version_by_alias("pixrl-policy", "rollout").run_id == out["run_id"]
    _, _, loss = offline("jsft", "token_sft")
    vocab = 64  # the tiny model's image codebook: a uniform policy's NLL per token is ln 64
    assert len(loss) == 3 and all(0 < m.value < 2 * math.log(vocab) for m in loss)


def test_token_sft_loss_is_the_winners_token_nll(tiny_janus):
    """−mean log π(token) over the winners' tokens under the scored policy; the losers do not enter,
    and one step on it raises the winners' likelihood."""
    from pixrl.algorithms.base import build_algorithm
    from pixrl.algorithms.replay import TokenReplayPolicy
    from pixrl.algorithms.token_sampling import sequence_log_probs
    from pixrl.artifacts.batch import RolloutBatch
    from pixrl.config.loader import load_config
    from pixrl.engines.policy import TrainablePolicy

    path, overrides = tiny_janus
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()] + ["algorithm=token_sft", "algorithm.lr=1e-2"])
    pol, algo = TrainablePolicy(cfg), build_algorithm(cfg.algorithm)
    fam, recipe = pol.family, algo.token_recipe
    g = torch.Generator().manual_seed(0)
    n = fam.image_token_count()
    winners, losers = torch.randint(0, 64, (2, n), generator=g), torch.randint(0, 64, (2, n), generator=g)
    cond = fam.encode_prompts(["a red circle", "a blue square"] * 2)

    def loss_of(lose):
        batch = RolloutBatch({"tokens": torch.cat([winners, lose]).numpy().astype(np.int32)})
        (loss, _), = list(algo.losses(batch, TokenReplayPolicy(fam, None, cond, recipe, fam.device)))
        return loss

    loss = loss_of(losers)
    with torch.no_grad():
        want = -sequence_log_probs(fam, cond.select([0, 1]), winners, recipe)[0].mean()
    assert torch.allclose(loss.detach(), want, atol=1e-6) and not algo.needs_reference
    assert torch.equal(loss_of(torch.randint(0, 64, (2, n), generator=g)).detach(), loss.detach())
    opt = pol.ensure_optimizer(None)
    loss.backward()
    opt.step()
    assert float(loss_of(losers)) < float(loss)


def test_resume_after_a_fault_in_update_is_bit_identical(tiny_janus, tmp_path, monkeypatch, prefect_harness):
    """A token run with the adaptive entropy coefficient: stopped by a fault in iteration 1's
    update and resumed, it ends with the uninterrupted run's weights, tokens and log-probs bit for
    bit — the coefficient's state (ψ and its Adam moments) came back from iteration 0's checkpoint."""
    import lance
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from pixrl.cli import app
    from pixrl.stages import session
    from pixrl.stages.chaos import ENV

    path, _ = tiny_janus
    args = ["--seed", "3", "model.family=janus_pro", "algorithm=token_grpo", "algorithm.lr=1e-3",
            "algorithm.entropy_target=5.0", "algorithm.entropy_coeff_lr=0.01", "algorithm.entropy_coeff_min=-0.1",
            "algorithm.entropy_coeff_max=0.1", "algorithm.optimizer_steps_per_iteration=2",
            "reward=jpeg_compressibility", "sampling.guidance_scale=5"]

    def train(run: str):
        return CliRunner().invoke(app, ["train", "--iterations", "2", "--run", run, *args,
                                        *tiny_overrides(path, tmp_path / run)])

    ref = train("ref")
    assert ref.exit_code == 0, ref.output
    monkeypatch.setenv(ENV, "update@1:raise")
    res = train("A")
    assert res.exit_code == 1 and "injected fault in update" in res.output
    monkeypatch.delenv(ENV)
    session._CURRENT.clear()  # as a new process would: nothing of the run is in memory
    res = CliRunner().invoke(app, ["resume", "A", "--workdir", str(tmp_path / "A")])
    assert res.exit_code == 0, res.output

    def final(run):
        (ck,) = (tmp_path / run / "checkpoints" / run).glob("*/it_0001")
        cols = ["iteration", "sample_id", "tokens", "log_probs", "advantage"]
        t = lance.dataset(str(tmp_path / run / "lance" / run / "trajectories.lance")).to_table(columns=cols)
        return load_file(str(ck / "trainable.safetensors")), t.sort_by([("iteration", "ascending"),
                                                                       ("sample_id", "ascending")])

    (w_ref, t_ref), (w_a, t_a) = final("ref"), final("A")
    assert set(w_ref) == set(w_a) and all(w_ref[k].equal(w_a[k]) for k in w_ref)
    assert t_ref.equals(t_a)


def test_pretrain_writes_a_token_miniature_the_family_loads(tmp_path):
    """`pixrl pretrain --family janus_pro` (a few steps): a Janus-Pro checkpoint in the transformers
    layout with its log; the family loads it and samples 32×32 images of 8×8 tokens."""
    from typer.testing import CliRunner

    from pixrl.cli import app

    out = tmp_path / "mini_janus"
    res = CliRunner().invoke(app, ["pretrain", "--family", "janus_pro", "--out", str(out), "--vq-steps", "2",
                                   "--ar-steps", "2", "--dataset-size", "64", "--threads", "1"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert (out / "pixrl_pretrain.json").is_file() and (tmp_path / "mini_janus.log.jsonl").is_file()
    fam = JanusProFamily.load(out)
    assert (fam.resolution, fam.image_token_count()) == (32, 64)
    traj = sample_tokens(fam, fam.encode_prompts(["a red circle"]), [torch.Generator().manual_seed(0)],
                         TokenRecipe(3.0))
    assert fam.decode(traj.tokens).shape == (1, 32, 32, 3)
