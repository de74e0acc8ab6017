"""Device check of the vLLM judge (needs a CUDA GPU and the environment `pixrl setup-vllm` makes):
serve a Qwen-VL checkout with `vllm serve` from that environment, score the same images with the
`vlm_judge` reward's vllm backend and its transformers backend, and report both scores' largest
difference and each backend's images/s. Exits 1 when they disagree by more than --tolerance.

    pixrl setup-vllm --venv .venv-vllm
    python benchmarks/gpu_vllm_judge.py --model /ckpt/Qwen2.5-VL-7B-Instruct [--images 64]
    python benchmarks/gpu_vllm_judge.py --tiny      # a tiny random Qwen2.5-VL (vLLM's kernels may refuse its widths)
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    from pixrl.cli.vllm import wait_until_serving

    try:
        wait_until_serving(url, proc, timeout_s)
    except RuntimeError as exc:
        raise SystemExit(f"vllm serve: {exc}; see its log above") from None


def shapes_images(n: int, size: int) -> tuple[np.ndarray, list[str]]:
    """Rendered shapes-world scenes with their captions (something a judge can say yes or no to),
    upscaled to `size` (nearest: the scenes are flat colours)."""
    from PIL import Image

    from pixrl.datasets.shapes.prompts import all_prompts, text_of
    from pixrl.datasets.shapes.render import render_prompt

    metas = all_prompts()
    picks = [metas[i] for i in np.random.default_rng(0).integers(0, len(metas), n)]
    imgs = [np.asarray(Image.fromarray(render_prompt(m, seed=i)).resize((size, size), Image.NEAREST))
            for i, m in enumerate(picks)]
    return np.stack(imgs), [text_of(m) for m in picks]


def timed_score(reward, images, prompts) -> tuple[np.ndarray, float]:
    reward.score(images[:2], prompts[:2], [{}] * 2)  # warm-up
    t0 = time.perf_counter()
    out = reward.score(images, prompts, [{}] * len(images))["vlm_judge"]
    return out, len(images) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Qwen2.5-VL / Qwen3-VL instruct checkout")
    ap.add_argument("--tiny", action="store_true", help="write a tiny random Qwen2.5-VL and judge with it")
    ap.add_argument("--venv", default=".venv-vllm", help="the environment `pixrl setup-vllm` made")
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tolerance", type=float, default=0.05, help="largest allowed |score difference| (bf16 vs bf16)")
    ap.add_argument("--startup-timeout", type=float, default=900)
    args = ap.parse_args()
    if not (args.model or args.tiny):
        raise SystemExit("give --model CHECKOUT or --tiny")
    model = args.model
    if args.tiny:
        from pixrl.models.tiny_parts import write_tiny_qwen25_vl

        model = str(write_tiny_qwen25_vl(Path(tempfile.mkdtemp()) / "Qwen2.5-VL-tiny"))
    vllm = Path(args.venv) / "bin" / "vllm"
    if not vllm.exists():
        raise SystemExit(f"{vllm} not found: run `pixrl setup-vllm --venv {args.venv}` first")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(vllm), "serve", model, "--port", str(port), "--max-logprobs", "20",
                             "--dtype", args.dtype, "--served-model-name", "judge"], stdout=sys.stderr)
    try:
        t0 = time.time()
        wait_ready(url, proc, args.startup_timeout)
        startup = time.time() - t0
        from pixrl.rewards.base import build_reward

        images, prompts = shapes_images(args.images, args.size)
        served = build_reward("vlm_judge", backend="vllm", url=url, served_model="judge")
        served.ensure_setup("cuda")
        local = build_reward("vlm_judge", path=model, dtype=args.dtype)
        local.ensure_setup("cuda")
        s_vllm, rate_vllm = timed_score(served, images, prompts)
        s_hf, rate_hf = timed_score(local, images, prompts)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    diff = float(np.max(np.abs(s_vllm - s_hf)))
    report = {"model": model, "images": args.images, "size": args.size, "dtype": args.dtype,
              "server_startup_s": round(startup, 1), "vllm_images_per_s": round(rate_vllm, 2),
              "transformers_images_per_s": round(rate_hf, 2), "max_abs_score_diff": diff,
              "mean_score_vllm": float(s_vllm.mean()), "mean_score_transformers": float(s_hf.mean())}
    print(json.dumps(report))
    if diff > args.tolerance:
        raise SystemExit(f"the backends disagree: max |Δscore| {diff:.4f} > {args.tolerance}")


if __name__ == "__main__":
    main()
