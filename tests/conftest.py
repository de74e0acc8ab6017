"""Shared fixtures: a tiny random SD3 checkpoint in the real diffusers layout, and a Prefect
test harness (temporary SQLite API server) for the flows."""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2` (the README's command): a core per worker, and
    os.environ["OMP_NUM_THREADS"] = "1"  # the same count in every `pixrl` process it starts (set before torch loads)

from pixrl.config.environment import apply_defaults  # noqa: E402

apply_defaults()

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# the pre-migrated MLflow store (artifacts/mlflow_store.py) of this test session, not the user's
os.environ["PIXRL_CACHE_DIR"] = tempfile.mkdtemp(prefix="pixrl-test-cache-")
atexit.register(shutil.rmtree, os.environ["PIXRL_CACHE_DIR"], True)

# torch's intra-op threads as this process started with them — what every `pixrl` subprocess a test
# starts gets too. Float reductions depend on the thread count, and tests compare runs in this
# process with runs in subprocesses bit for bit (the resume matrix, parity against recorded runs).
START_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A test that sets this process's torch threads (an in-process Ray worker does, by design)
    leaves the next test the count it started with."""
    yield
    if torch.get_num_threads() != START_THREADS:
        torch.set_num_threads(START_THREADS)

TINY_SPEC = dict(image_size=16, vae_channels=(8, 16), latent_channels=4, text_hidden=16, text_layers=2,
                 num_layers=1, heads=2, head_dim=16)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from pixrl.models.mini.build import MiniSpec, build_random_checkpoint

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("ckpt") / "tiny-sd3"
    return build_random_checkpoint(out, MiniSpec(**TINY_SPEC), seed=0)


@pytest.fixture(scope="session")
def prefect_harness():
    """Prefect's test harness (a temporary API server), its server watched as `pixrl train`'s is:
    if pytest dies without running its teardown (SIGKILL, an abort at exit), the watchdog stops
    the server instead of leaving it to init holding a port and the output pipe."""
    import os
    import subprocess
    import sys

    import psutil
    from prefect.testing.utilities import prefect_test_harness

    import pixrl.flows

    dog = Path(pixrl.flows.__file__).with_name("_server_watchdog.py")
    with prefect_test_harness(server_startup_timeout=120):
        for child in psutil.Process().children(recursive=True):
            try:
                cmd = " ".join(child.cmdline())
            except psutil.Error:
                continue
            if "uvicorn" in cmd and "prefect" in cmd:
                subprocess.Popen([sys.executable, str(dog), str(os.getpid()), str(child.pid)])
        yield


def start_reward_service(spec: str, *extra: str):
    """`pixrl reward-serve --reward SPEC` on a free local port, as its own process (with `extra`
    arguments: options, a token, limits): (the process, its URL) once /health answers."""
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pixrl.cli", "reward-serve", "--reward", spec, "--port", str(port),
                             *extra], cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, "PIXRL_REWARD_TOKEN": ""})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"reward-serve exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("reward-serve did not come up in 90 s")


def tiny_overrides(ckpt: Path, workdir: Path, **extra) -> list[str]:
    base = {"model.path": str(ckpt), "run.workdir": str(workdir), "sampling.group_size": 4,
            "sampling.prompts_per_iteration": 2, "sampling.micro_batch": 4, "sampling.steps": 4,
            "sampling.eval_steps": 4, "run.eval_every": 0, "sampling.window_size": 2, "sampling.window_range": "[0,2]"}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def train_args(ckpt: Path, workdir: Path, run: str, *extra: str, iterations: int = 2, seed: int = 7) -> list[str]:
    """`pixrl train` of the tiny checkpoint with the JPEG reward (fast, deterministic), `extra`
    overrides last: the run the resume and overlap drills compare bit for bit."""
    return ["train", "--iterations", str(iterations), "--run", run, "--seed", str(seed), "reward=jpeg_compressibility",
            *tiny_overrides(ckpt, workdir), *extra]


@pytest.fixture(scope="session")
def tiny_dino(tmp_path_factory) -> Path:
    """A tiny random DINOv2 with its image processor, saved in the transformers layout."""
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("dino")
    Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                             image_size=32, patch_size=8)).save_pretrained(out)
    BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                      image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]).save_pretrained(out)
    return out


def fault_then_resume(monkeypatch, start, wd: Path, run: str, point: str = "update@1:raise") -> None:
    """`start()` (a `pixrl train` of run `run` in `wd`) fails at the injected fault `point`, then
    `pixrl resume` — as a new process — finishes the run."""
    from typer.testing import CliRunner

    from pixrl.cli import app
    from pixrl.stages import session
    from pixrl.stages.chaos import ENV

    monkeypatch.setenv(ENV, point)
    res = start()
    stage = point.split("@")[0]
    assert res.exit_code == 1 and f"injected fault in {stage}" in res.output, res.output
    monkeypatch.delenv(ENV)
    session._CURRENT.clear()  # as a new process would
    res = CliRunner().invoke(app, ["resume", run, "--workdir", str(wd)])
    assert res.exit_code == 0, res.output


def two_iterations(tiny: tuple[Path, dict], tmp_path: Path, run: str, mode: str, *args: str,
                   algorithm: str = "flow_grpo", base_weights: str = "transformer/diffusion_pytorch_model.safetensors"):
    """`pixrl train --iterations 2` on a tiny family checkpoint with LoRA (rank 4) or full fine-tuning
    (`mode`), through the real flow; checks what every family must show — 16 complete rows of that
    family, two registered versions, trained weights that moved (LoRA: adapter tensors only;
    full: against the checkpoint's `base_weights` file) — and returns (the run's summary, its
    Lance table). `algorithm`: the algorithm preset (flow_grpo's LoRA mode uses its LoRA preset)."""
    import json

    import lance
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from pixrl.cli import app

    path, overrides = tiny
    extra = {k: v for k, v in overrides.items() if k != "model.path"}
    lora = ["algorithm.lora.enabled=true", "algorithm.lora.rank=4", "algorithm.lora.alpha=8"]
    if algorithm == "flow_grpo":
        algo = ["algorithm=flow_grpo_lora", *lora[1:]] if mode == "lora" else []
    else:
        algo = [f"algorithm={algorithm}", *(lora if mode == "lora" else [])]
    res = CliRunner().invoke(app, ["train", "--iterations", "2", "--run", run, "reward=jpeg_compressibility", *algo,
                                   *tiny_overrides(path, tmp_path, **extra), *args])
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    t = lance.dataset(out["table_uri"]).to_table()
    assert t.num_rows == 16 and set(t["family"].to_pylist()) == {overrides["model.family"]}
    assert all(t[c].null_count == 0 for c in ("image", "reward", "advantage", "log_probs"))
    versions = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_model_versions(f"name='{out['model_name']}'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    cks = sorted((tmp_path / "checkpoints" / run).glob("*/it_*"))
    last = load_file(str(cks[-1] / "trainable.safetensors"))
    if mode == "lora":
        first = load_file(str(cks[0] / "trainable.safetensors"))
        assert first and all("lora" in k for k in first)
        assert any(not torch.equal(first[k], last[k]) for k in first), "the LoRA update changed no adapter weight"
    else:
        base = load_file(str(path / base_weights))
        base = {k: v for k, v in base.items() if k in last} if algorithm != "flow_grpo" else base
        assert set(base) <= set(last) and any(not torch.equal(last[k], base[k]) for k in base), \
            "the update changed no transformer weight"
    return out, t


def _tiny_family(tmp_path_factory, family: str) -> tuple[Path, dict]:
    """A tiny random checkpoint of `family` in its real layout (what `pixrl tiny FAMILY` writes) and
    the overrides that run it."""
    from pixrl.models.registry import get_family

    out = tmp_path_factory.mktemp("ckpt") / f"tiny-{family}"
    return out, get_family(family).write_tiny(out, seed=0)


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory) -> tuple[Path, dict]:
    """FLUX.1-dev-shaped."""
    return _tiny_family(tmp_path_factory, "flux1")


@pytest.fixture(scope="session")
def tiny_flux_kontext(tmp_path_factory) -> tuple[Path, dict]:
    """FLUX.1-Kontext-dev-shaped, with its tiny editing prompt set (`edits/edits.jsonl`)."""
    return _tiny_family(tmp_path_factory, "flux1_kontext")


@pytest.fixture(scope="session")
def tiny_qwen_image(tmp_path_factory) -> tuple[Path, dict]:
    """Qwen-Image-shaped."""
    return _tiny_family(tmp_path_factory, "qwen_image")


@pytest.fixture(scope="session")
def tiny_sana(tmp_path_factory) -> tuple[Path, dict]:
    """SANA-shaped."""
    return _tiny_family(tmp_path_factory, "sana")


@pytest.fixture(scope="session")
def tiny_flux2(tmp_path_factory) -> tuple[Path, dict]:
    """FLUX.2-dev-shaped."""
    return _tiny_family(tmp_path_factory, "flux2")


@pytest.fixture(scope="session")
def tiny_flux2_klein(tmp_path_factory) -> tuple[Path, dict]:
    """FLUX.2-klein-base-shaped (Qwen3 encoder, true CFG)."""
    return _tiny_family(tmp_path_factory, "flux2_klein")


@pytest.fixture(scope="session")
def tiny_lumina2(tmp_path_factory) -> tuple[Path, dict]:
    """Lumina-Image-2.0-shaped (Gemma-2 captions under the system prompt, next-DiT, −v at 1 − σ)."""
    return _tiny_family(tmp_path_factory, "lumina2")


@pytest.fixture(scope="session")
def tiny_sd15(tmp_path_factory) -> tuple[Path, dict]:
    """Stable-Diffusion-1.5-shaped (ε-prediction UNet, DDPM schedule)."""
    return _tiny_family(tmp_path_factory, "sd15")


@pytest.fixture(scope="session")
def tiny_sdxl(tmp_path_factory) -> tuple[Path, dict]:
    """Stable-Diffusion-XL-shaped (two CLIP towers, text-time added conditioning)."""
    return _tiny_family(tmp_path_factory, "sdxl")


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory) -> tuple[Path, dict]:
    """Wan2.1-shaped text-to-video."""
    return _tiny_family(tmp_path_factory, "wan")


@pytest.fixture(scope="session")
def tiny_janus(tmp_path_factory) -> tuple[Path, dict]:
    """Janus-Pro-shaped (token-autoregressive)."""
    return _tiny_family(tmp_path_factory, "janus_pro")


def perturbed_sd3(ckpt: Path, seeds: list[int], scale: float = 0.02) -> list:
    """Frozen SD3 families of the tiny checkpoint, each with its transformer's weights moved by
    scale·N(0, 1) from `seed`: the other policies a loss reads (a reference, an EMA, a sampler)."""
    from pixrl.models.sd3 import SD3Family

    out = []
    for seed in seeds:
        fam = SD3Family.load(ckpt, max_sequence_length=0)
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in fam.transformer.parameters():
                p.add_(scale * torch.randn_like(p))
        fam.transformer.requires_grad_(False)
        out.append(fam)
    return out
