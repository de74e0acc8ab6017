"""The semantic chain of thought before the image (T2I-R1's BiCoT; `sampling.cot_tokens`) on the
tiny Janus checkpoint: text sampled from the language-model head until its end-of-sentence
token, the image prompt embedding exactly the sampled ids, rollout → replay log-probs equal for
text and image, a sample independent of its batch, clear errors, and Token-GRPO over [text ;
image] through the real flow — resumed bit for bit with adaptive image and text entropy
coefficients."""

import json

import numpy as np
import pytest
import torch

from conftest import tiny_overrides
from pixrl.algorithms.replay import TokenReplayPolicy
from pixrl.algorithms.token_sampling import TokenRecipe, sample_with_cot, sequence_log_probs
from pixrl.models.janus import JanusProFamily

PROMPTS = ["a red circle", "two blue squares on the left of a green triangle", "a cat"]
TEMPLATE = "Describe {prompt}:"


@pytest.fixture(scope="module")
def family(tiny_janus):
    """The tiny checkpoint with the end-of-sentence logit raised (its word embedding, tied to the
    language-model head, scaled), so that chains of thought end inside a short budget."""
    fam = JanusProFamily.load(tiny_janus[0])
    with torch.no_grad():
        fam.model.lm_head.weight[fam.eos_id] *= 40
    return fam


def _cot(family, budget=12, seeds=(1, 2, 3), rows=(0, 1, 2)):
    recipe = TokenRecipe(5.0, 1.0, 0, budget, 1.3, TEMPLATE)
    cot = family.encode_cot_prompts(PROMPTS, TEMPLATE, budget)
    return recipe, cot, sample_with_cot(family, cot, list(rows), [torch.Generator().manual_seed(s) for s in seeds],
                                        recipe)


def test_the_chain_of_thought_ends_at_its_end_of_sentence_token(family):
    _, _, traj = _cot(family)
    toks, mask = traj.cot_tokens, traj.cot_mask
    ended = 0
    for t, m in zip(toks.tolist(), mask.tolist()):
        n = sum(m)
        assert m == [1] * n + [0] * (len(m) - n)  # sampled tokens first, then padding
        assert all(x == family.pad_id for x in t[n:])
        if family.eos_id in t[:n]:
            assert t.index(family.eos_id) == n - 1  # nothing is sampled after the end
            ended += 1
    assert ended >= 1, "the raised end-of-sentence logit should end at least one text inside the budget"
    assert torch.all(traj.cot_log_probs[mask == 0] == 0) and torch.all(traj.cot_log_probs[mask == 1] < 0)


def test_the_image_prompt_embeds_the_sampled_ids(family):
    recipe, cot, traj = _cot(family)
    cond = family.cot_image_prompts(cot, [0, 1, 2], traj.cot_tokens, traj.cot_mask)
    special = set(family.tokenizer.all_special_ids)
    assert cond.ids.shape[1] == cot.width
    for r in range(3):
        ids = cond.ids[r][cond.mask[r] == 1].tolist()
        words = [t for t, m in zip(traj.cot_tokens[r].tolist(), traj.cot_mask[r].tolist()) if m and t not in special]
        assert ids == cot.heads[r] + words + cot.tail
        text = family.tokenizer.decode(ids)
        assert text.startswith(f"<|begin▁of▁sentence|><|User|>: {PROMPTS[r]}. ") or PROMPTS[r] in text
        uncond = cond.uncond_ids[r][cond.mask[r] == 1].tolist()  # CFG: all but BOS and <begin_of_image> padded
        assert uncond[0] == family.bos_id and uncond[-1] == family.boi_id
        assert set(uncond[1:-1]) == {family.pad_id}


def test_replay_reproduces_text_and_image_log_probs_exactly(family):
    recipe, cot, traj = _cot(family)
    cond = family.cot_image_prompts(cot, [0, 1, 2], traj.cot_tokens, traj.cot_mask)
    policy = TokenReplayPolicy(family, None, cond, recipe, family.device, cot.text.select([0, 1, 2]))
    family.model.requires_grad_(True)
    try:
        text, _ = policy.text_log_probs(traj.cot_tokens, traj.cot_mask)
        image, _ = sequence_log_probs(family, cond, traj.tokens, recipe)
        assert text.requires_grad and image.requires_grad
        assert torch.equal(text.detach(), traj.cot_log_probs) and torch.equal(image.detach(), traj.log_probs)
    finally:
        family.model.requires_grad_(False)


def test_a_sample_with_its_thought_does_not_depend_on_its_batch(family):
    _, _, both = _cot(family, seeds=(5, 6, 7))
    _, _, alone = _cot(family, seeds=(6,), rows=(1,))
    assert both.cot_tokens[1].tolist() == alone.cot_tokens[0].tolist()
    assert both.tokens[1].tolist() == alone.tokens[0].tolist()
    assert torch.equal(both.log_probs[1], alone.log_probs[0])


def test_bad_chain_of_thought_settings_fail_before_any_work(tiny_janus, tmp_path):
    from typer.testing import CliRunner

    from pixrl.cli import app

    base = ["train", "--iterations", "1", "reward=jpeg_compressibility"]
    janus = [*base, "model.family=janus_pro", "algorithm=token_grpo", *tiny_overrides(tiny_janus[0], tmp_path)]
    cases = [([*janus, "sampling.cot_tokens=8", 'sampling.cot_template="no placeholder"'], "must contain {prompt}"),
             ([*janus, "sampling.cot_tokens=250", f'sampling.cot_template="{TEMPLATE}"'], "shorten the prompt"),
             ([*base, f"run.workdir={tmp_path}", "sampling.cot_tokens=8"], "samples no chain of thought")]  # the miniature
    for args, message in cases:
        res = CliRunner().invoke(app, args)
        assert res.exit_code != 0 and message in res.output, res.output
    assert not (tmp_path / "lance").exists()


def test_token_grpo_with_a_chain_of_thought_resumes_bit_identical(tiny_janus, tmp_path, monkeypatch, prefect_harness):
    """Two iterations: text and image tokens stored with their log-probs and the text's mask,
    replayed at ratio exactly 1, both adaptive α's stepping; stopped by a fault in iteration 1's
    update and resumed, the run ends with the uninterrupted run's weights and rows."""
    import lance
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from pixrl.cli import app
    from pixrl.stages import session
    from pixrl.stages.chaos import ENV

    path, _ = tiny_janus
    args = ["--seed", "4", "model.family=janus_pro", "algorithm=token_grpo", "algorithm.lr=1e-3",
            "reward=jpeg_compressibility", "sampling.guidance_scale=5", "sampling.cot_tokens=6",
            f'sampling.cot_template="{TEMPLATE}"', "algorithm.entropy_target=5.0", "algorithm.text_entropy_target=2.0",
            "algorithm.entropy_coeff_lr=0.01", "algorithm.entropy_coeff_min=-0.1", "algorithm.entropy_coeff_max=0.1"]

    def train(run: str):
        return CliRunner().invoke(app, ["train", "--iterations", "2", "--run", run, *args,
                                        *tiny_overrides(path, tmp_path / run)])

    ref = train("ref")
    assert ref.exit_code == 0, ref.output
    out = json.loads(ref.stdout.strip().splitlines()[-1])
    client = MlflowClient(f"sqlite:///{tmp_path / 'ref' / 'mlflow.db'}")
    hist = {k: [m.value for m in sorted(client.get_metric_history(out["run_id"], k), key=lambda m: m.step)]
            for k in ("onpolicy_ratio_dev", "entropy_text", "text_entropy_coeff", "entropy_coeff", "cot_length")}
    assert hist["onpolicy_ratio_dev"] == [0.0, 0.0]
    assert len(hist["entropy_text"]) == 2 and all(v > 0 for v in hist["entropy_text"])
    assert hist["text_entropy_coeff"][0] != 0 and hist["entropy_coeff"][0] != 0  # both α's stepped
    assert all(0 < v <= 6 for v in hist["cot_length"])

    monkeypatch.setenv(ENV, "update@1:raise")
    res = train("A")
    assert res.exit_code == 1 and "injected fault in update" in res.output
    monkeypatch.delenv(ENV)
    session._CURRENT.clear()  # as a new process would
    res = CliRunner().invoke(app, ["resume", "A", "--workdir", str(tmp_path / "A")])
    assert res.exit_code == 0, res.output

    def final(run):
        (ck,) = (tmp_path / run / "checkpoints" / run).glob("*/it_0001")
        cols = ["iteration", "sample_id", "tokens", "log_probs", "cot_tokens", "cot_mask", "cot_log_probs", "advantage"]
        t = lance.dataset(str(tmp_path / run / "lance" / run / "trajectories.lance")).to_table(columns=cols)
        return load_file(str(ck / "trainable.safetensors")), t.sort_by([("iteration", "ascending"),
                                                                       ("sample_id", "ascending")])

    (w_ref, t_ref), (w_a, t_a) = final("ref"), final("A")
    assert all(w_ref[k].equal(w_a[k]) for k in w_ref) and t_ref.equals(t_a)
    mask = np.stack(t_ref["cot_mask"].to_numpy(zero_copy_only=False))
    assert mask.shape == (16, 6) and set(np.unique(mask)) <= {0, 1}
    recipe = json.loads(lance.dataset(str(tmp_path / "ref" / "lance" / "ref" / "trajectories.lance"))
                        .to_table(columns=["recipe"])["recipe"][0].as_py())
    assert (recipe["cot_tokens"], recipe["cot_template"]) == (6, TEMPLATE)
    res = CliRunner().invoke(app, ["dpo", "--from", "ref", "-n", "1", "--run", "jdpo", "--workdir", str(tmp_path / "ref"),
                                   "model.family=janus_pro", f"model.path={path}", "algorithm=token_dpo"])
    assert res.exit_code != 0 and "chain of thought" in res.output, res.output  # token DPO scores plain prompts


def test_rollout_correction_weights_only_the_text_tokens_a_server_sampled(family):
    """With the server's log-probs 0.5 nats below the policy's on every text token (ρ = e^0.5 ≈ 1.65,
    under the cap 2), token_truncate weights each text token's PPO term by ρ and each image token's
    by 1; the loss equals that weighted masked token mean, written out."""
    import numpy as np

    from pixrl.algorithms.base import build_algorithm
    from pixrl.algorithms.token_grpo import token_ppo_loss
    from pixrl.artifacts.batch import RolloutBatch
    from pixrl.config.schema import AlgorithmConfig

    recipe, cot, traj = _cot(family)
    cond = family.cot_image_prompts(cot, [0, 1, 2], traj.cot_tokens, traj.cot_mask)
    policy = TokenReplayPolicy(family, None, cond, recipe, family.device, cot.text.select([0, 1, 2]))
    behavior = (traj.cot_log_probs - 0.5) * traj.cot_mask
    batch = RolloutBatch({"tokens": traj.tokens.numpy().astype(np.int32), "log_probs": traj.log_probs.numpy(),
                          "cot_tokens": traj.cot_tokens.numpy().astype(np.int32),
                          "cot_mask": traj.cot_mask.numpy().astype(np.int8), "cot_log_probs": traj.cot_log_probs.numpy(),
                          "cot_behavior_log_probs": behavior.numpy(), "advantage": np.array([1.0, -0.5, 2.0], np.float32)})
    algo = build_algorithm(AlgorithmConfig(name="token_grpo", rollout_correction="token_truncate"))
    with torch.no_grad():
        ((loss, m),) = list(algo.losses(batch, policy))
    new = torch.cat([traj.cot_log_probs, traj.log_probs], 1)  # on-policy: the replay equals the rollout
    weights = torch.cat([torch.full_like(traj.cot_log_probs, float(np.exp(0.5))), torch.ones_like(traj.log_probs)], 1)
    mask = torch.cat([traj.cot_mask, torch.ones_like(traj.tokens)], 1)
    want, _ = token_ppo_loss(new, new, torch.tensor([1.0, -0.5, 2.0]), 0.2, 0.2, mask, weights)
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    assert float(m["rollout_is/ratio_mean"]) == pytest.approx(float(np.exp(0.5)), rel=1e-5)
    assert float(m["rollout_is/corrected_frac"]) == 0.0
