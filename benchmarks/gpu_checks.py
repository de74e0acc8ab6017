"""The one prepared script of a session that is lent a GPU: it receives the device kit
(benchmarks/device_kit.py), installs it, and runs the GPU checks of the open issues in priority
order, each in its own process group under its own timeout, all inside one call's time.

Every call of the session is the same command, carrying the next part of the kit:

    python3 benchmarks/device_kit.py build --with video          # here, first: prints the calls
    run(command="PYTHONUNBUFFERED=1 python3 benchmarks/gpu_checks.py", carry=[".device_kit/part01"], timeout_s=600)
    run(command=..., carry=[".device_kit/part02"], timeout_s=600)   # within 30 s, or the machine goes back
    ...

A call that leaves parts missing only stores its part (seconds) and says which comes next; the
call that completes the kit installs it and runs the checks. Results: $OUT/checks.jsonl (one line
per check: name, command, exit code, seconds, the check's own JSON result) and $OUT/checks.log
(everything the checks printed). `--only a,b` runs some checks; `--list` shows them.

The checks (priority order: first what has not yet passed on the H200, docs/runs/gpu_smoke;
each family's `gpu_smoke.py` is one iteration of the real flow):
  environment   GPU, torch, the kit's requirements, pixrl's imports
  wan           Wan2.1-1.3B, 33 frames of 512², activation checkpointing (kit --with video); wan_480x832
                the same at its own 480×832
  flux1 …       FLUX.1-dev (8 + 16 of 19 + 38 blocks), FLUX.1-Kontext-dev (the same), Janus-Pro-1B, FLUX.2-dev (2 + 12 of 8 + 48),
                Wan2.2-T2V-A14B (two experts, 8 of 40 blocks each)
  sd3 …         SD3.5-Medium (24 blocks; issue 14's line), SANA-1600M, Qwen-Image (12 of 60 blocks):
                passed on 2026-12-04
  flux2_resident  FLUX.2 again with its text tower resident: the memory the offload frees
  scaling       benchmarks/scaling.py --device cuda --gpus 1 (kit --with ray)
Each check's line carries the GPU's peak used memory as `nvidia-smi` saw it (also when it fails),
and its log Prefect's task lines with their times (how far a check stopped at its limit got). A
check that failed with a CUDA error (not out of memory) is run again at the end, time left,
with CUDA_LAUNCH_BLOCKING=1 (`NAME+blocking`): the error then names the kernel that caused it;
when that is still a cuBLAS GEMM, once more with TORCH_BLAS_PREFER_CUBLASLT=1 (`NAME+cublaslt`).

`--device cpu --tiny` takes the same path on tiny models: how the kit is checked on a machine
without a GPU (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import device_kit  # noqa: E402  (stdlib only: importable before the kit is installed)

SMOKE = "benchmarks/gpu_smoke.py"
# name → (argv after the interpreter, timeout s, the kit profile it needs or None)
CHECKS = {
    # First what has not yet passed on the H200 (docs/runs/gpu_smoke, 2026-12-04): Wan ran out of
    # memory in its update (now with activation checkpointing), FLUX.1 failed in a cuBLAS GEMM of its
    # backward, Janus-Pro ran past 150 s, FLUX.2 had no time left. The three largest at real widths
    # with fewer blocks, so that every family fits one lease's call; at full depth:
    # `--only flux1 --full-depth` (flux1's 12B fits the GPU and the disk).
    "wan": ([SMOKE, "--family", "wan"], 180, "video"),
    "flux1": ([SMOKE, "--family", "flux1", "--layers", "8"], 200, None),
    # new since: FLUX.1 Kontext (instruction editing): FLUX.1's shapes with the source's 1024 tokens more
    "flux1_kontext": ([SMOKE, "--family", "flux1_kontext", "--layers", "8"], 200, None),
    "janus_pro": ([SMOKE, "--family", "janus_pro"], 240, None),
    "flux2": ([SMOKE, "--family", "flux2", "--layers", "2"], 300, None),  # text tower offloaded, as its preset
    # new since: Wan2.1-1.3B at its own 480×832 (a non-square size: 1.5× the tokens of 512²)
    "wan_480x832": ([SMOKE, "--family", "wan", "--resolution", "480", "--width", "832"], 200, "video"),
    # Wan2.2-T2V-A14B's two experts (new since that lease): 8 of 40 blocks each, at their real width
    "wan_a14b": ([SMOKE, "--family", "wan_a14b", "--layers", "8"], 240, "video"),
    # Wan2.1-I2V-14B (image-to-video, new since): 8 of 40 blocks at the real width, CLIP ViT-H/14
    "wan_i2v": ([SMOKE, "--family", "wan_i2v", "--layers", "8"], 240, "video"),
    # Z-Image-Turbo (new since): the full 6.2B transformer, without CFG as the Turbo samples
    "z_image": ([SMOKE, "--family", "z_image"], 180, None),
    # HunyuanVideo-1.5 (new since): 16 of its 54 blocks at the real width, 33 frames
    "hunyuan_video15": ([SMOKE, "--family", "hunyuan_video15", "--layers", "16"], 240, "video"),
    # HunyuanVideo 1.0 (new since): 8 dual- and 16 single-stream blocks at the real width, 33 frames
    "hunyuan_video": ([SMOKE, "--family", "hunyuan_video", "--layers", "8"], 240, "video"),
    "skyreels_i2v": ([SMOKE, "--family", "skyreels_i2v", "--layers", "8"], 240, "video"),  # its image-to-video
    # new since: LTX-Video 0.9.1 (2B at full depth, 65 frames at 512²: 9 × 16 × 16 latent tokens)
    "ltx_video": ([SMOKE, "--family", "ltx_video"], 200, "video"),
    # new since: Mochi 1, 16 of its 48 blocks at the real width, 19 frames (4 × 32 × 32 latents at 512²)
    "mochi": ([SMOKE, "--family", "mochi", "--layers", "16"], 240, "video"),
    # new since: CogVideoX-5B at full depth, 25 frames (7 × 32 × 32 latents at 512²)
    "cogvideox": ([SMOKE, "--family", "cogvideox"], 240, "video"),
    # new since: Wan2.2-TI2V-5B's image-to-video at full depth, 33 frames of 8 random first frames
    "wan_ti2v": ([SMOKE, "--family", "wan_ti2v"], 240, "video"),
    "ltx_video_i2v": ([SMOKE, "--family", "ltx_video_i2v"], 200, "video"),  # LTX-Video's image-to-video
    "cogvideox_i2v": ([SMOKE, "--family", "cogvideox_i2v"], 240, "video"),  # CogVideoX1.5-5B-I2V, full depth
    # new since: Cosmos-Predict2-2B text-to-image at full depth (EDM grid as a flow, T5-11B at its width)
    "cosmos2": ([SMOKE, "--family", "cosmos2"], 180, None),
    "cosmos2_v2w": ([SMOKE, "--family", "cosmos2_v2w"], 240, "video"),  # its Video2World, 33 frames
    "cosmos25": ([SMOKE, "--family", "cosmos25"], 240, "video"),  # Cosmos-Predict2.5-2B Text2World, 33 frames
    # new since: GLM-Image's 7B decoder at full depth, the autoregressive model at its width sampling priors
    "glm_image": ([SMOKE, "--family", "glm_image"], 200, None),
    "glm_image_ar": ([SMOKE, "--family", "glm_image_ar"], 200, None),  # its autoregressive model, Token-GRPO
    # new since: HunyuanImage-2.1 (8 + 16 of its 20 + 40 blocks at the real width) under its APG guiders
    "hunyuan_image": ([SMOKE, "--family", "hunyuan_image", "--layers", "8"], 240, None),
    "ltx2": ([SMOKE, "--family", "ltx2", "--layers", "8"], 240, "video"),  # LTX-2's audio-video DiT
    "ltx2_i2v": ([SMOKE, "--family", "ltx2_i2v", "--layers", "8"], 240, "video"),  # its image-to-audio+video
    # passed there: sd3 (issue 14's line) 144 s, sana 68 s, qwen_image (12 blocks) 79 s
    "sd3": ([SMOKE, "--family", "sd3"], 240, None),
    # new since: SD1.5's UNet with DDPO's recipe (860M, every step of DDIM-η stored)
    "sd15": ([SMOKE, "--family", "sd15"], 150, None),
    "sdxl": ([SMOKE, "--family", "sdxl"], 200, None),
    "pixart_sigma": ([SMOKE, "--family", "pixart_sigma"], 150, None),  # new since: PixArt-Σ at full depth
    # new since: Qwen-Image-Edit, 12 of 60 blocks with the 1024² source's 4096 tokens beside the target's
    "qwen_image_edit": ([SMOKE, "--family", "qwen_image_edit", "--layers", "12"], 240, None),
    # new since: Qwen-Image-2.1 (single-stream DiT over Qwen3-VL, 16× RGBA VAE), 12 of 32 blocks
    "qwen_image21": ([SMOKE, "--family", "qwen_image21", "--layers", "12"], 240, None),
    # new since: Qwen-Image-Edit-2511 (the Plus pipeline: the source at 384² to Qwen2.5-VL, zero_cond_t)
    "qwen_image_edit_plus": ([SMOKE, "--family", "qwen_image_edit_plus", "--layers", "12"], 240, None),
    "sana": ([SMOKE, "--family", "sana"], 150, None),
    # new since: SRPO's reward-gradient update on SD3.5-Medium (full fine-tune) through the VAE decode and
    # a CLIP of ViT-H/14's shapes (HPSv2's) — the memory a Direct-Align update takes at real widths
    "sd3_srpo": ([SMOKE, "--family", "sd3", "--srpo"], 240, None),
    # new since: DRaFT-2's update on SD3.5-Medium (full fine-tune): two steps' activations, the decode and
    # the ViT-H/14-shaped CLIP with the gradient on
    "sd3_draft": ([SMOKE, "--family", "sd3", "--draft", "2"], 240, None),
    "qwen_image": ([SMOKE, "--family", "qwen_image", "--layers", "12"], 200, None),
    # the same without the offload: the accelerator memory the offload frees (Mistral-3 at real width)
    "flux2_resident": ([SMOKE, "--family", "flux2", "--layers", "2", "--set", "model.offload_text_encoders=false"],
                       300, None),
    "scaling": (["benchmarks/scaling.py", "--device", "cuda", "--gpus", "1", "--iterations", "3"], 300, "ray"),
}
# A check that failed with a CUDA error is run again at the end, time left: first with synchronous
# launches (the error then names the kernel that caused it); when that still fails in cuBLAS, with
# PyTorch's cuBLASLt path for its GEMMs (whether the fault is in cuBLAS's own GEMM for those shapes).
RERUNS = [
    ("blocking", {"CUDA_LAUNCH_BLOCKING": "1"}, lambda res: "CUBLAS_STATUS" in res.get("tail", "")),
    ("cublaslt", {"TORCH_BLAS_PREFER_CUBLASLT": "1"}, lambda res: False),
]
MIN_START_S = 45  # a check is not started with less than this left before the deadline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated check names (default: all, in order)")
    ap.add_argument("--deadline", type=float, default=560.0, help="seconds from start to stop starting checks")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny models (the CPU check of the kit and this script)")
    ap.add_argument("--full-depth", action="store_true", help="every family at its real block count (no --layers)")
    ap.add_argument("--no-kit", action="store_true", help="use this environment as it is (pixrl installed)")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    if args.list:
        print("\n".join(f"{n}: {' '.join(a)} (≤{t} s{', kit --with ' + p if p else ''})" for n, (a, t, p) in CHECKS.items()))
        return
    start = time.monotonic()
    env, profiles = (dict(os.environ), None) if args.no_kit else _kit_env()
    if env is None:
        return  # a part was stored; the next call carries the next one
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="pixrl-gpu-checks-"))
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in (args.only.split(",") if args.only else CHECKS) if n and n != "environment"]  # always first
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        sys.exit(f"unknown check(s) {unknown}; `--list` shows them")
    log = open(out / "checks.log", "a")
    record(out, environment(env, log))
    failed = []
    for name in names:
        argv, limit, needs = CHECKS[name]
        left = args.deadline - (time.monotonic() - start)
        if profiles is not None and needs and needs not in profiles:
            record(out, {"check": name, "skipped": f"the kit lacks '{needs}': build it with --with {needs}"})
        elif left < MIN_START_S:
            record(out, {"check": name, "skipped": f"{left:.0f} s left before the deadline"})
        else:
            res = run_check(name, _adapt(argv, args), min(limit, left), env, log)
            record(out, res)
            failed += [name] if kernel_failure(res) else []
    for name in failed:  # with time left: the diagnostic reruns, each while the failure persists
        argv, limit, _ = CHECKS[name]
        for suffix, extra, persists in RERUNS:
            left = args.deadline - (time.monotonic() - start)
            if left < MIN_START_S:
                break
            res = run_check(f"{name}+{suffix}", _adapt(argv, args), min(2 * limit, left), dict(env, **extra), log)
            record(out, res)
            if not persists(res):
                break
    log.close()
    print(f"results: {out / 'checks.jsonl'}; {time.monotonic() - start:.0f} s in all")


def _kit_env() -> tuple[dict | None, list[str] | None]:
    """Receive this call's part; once every part is here, install and return the environment
    the checks run in (the kit's site first, then this checkout) and the kit's profiles."""
    manifest, have = device_kit.receive()
    if manifest is None:
        sys.exit("no kit part here: build one (`python3 benchmarks/device_kit.py build`) and carry .device_kit/part01")
    total = len(manifest["parts"])
    if len(have) < total:
        nxt = min(set(range(1, total + 1)) - set(have))
        print(f"kit {manifest['kit'][:12]}: holding parts {have} of {total}; the next call carries .device_kit/part{nxt:02d}")
        return None, None
    site = device_kit.install(manifest)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_HOME=tempfile.mkdtemp(prefix="prefect-home-"),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PIXRL_KIT_SITE=str(site))
    return env, manifest["profiles"]


def _adapt(argv: list[str], args) -> list[str]:
    if args.tiny or getattr(args, "full_depth", False):
        argv = [a for i, a in enumerate(argv) if a != "--layers" and not (i and argv[i - 1] == "--layers")]
    if args.tiny:
        if argv[0] == SMOKE:
            argv = [*argv, "--tiny", "--steps", "4"]
    if argv[0] == SMOKE:
        argv = [*argv, "--device", args.device]
    elif args.device == "cpu":  # scaling on CPU: workers on cores instead of GPUs
        argv = [argv[0], "--iterations", "2"]
    return argv


def environment(env: dict, log) -> dict:
    """What the checks run on, and whether pixrl imports there (fails fast, before any model)."""
    code = ("import json, sys, torch, importlib.metadata as m\n"
            "import pixrl.flows.online, pixrl.stages.online\n"
            "sys.path.insert(0, 'benchmarks'); import device_kit\n"
            "site = device_kit.SITE\n"
            "info = dict(python=sys.version.split()[0], torch=torch.__version__, cuda=torch.cuda.is_available(),\n"
            "  gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None, cuda_runtime=torch.version.cuda,\n"
            "  gpu_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if torch.cuda.is_available() else None,\n"
            "  versions={p: m.version(p) for p in ('prefect','mlflow','pylance','diffusers','transformers','peft','pyarrow','numpy')},\n"
            "  kit_problems=device_kit.check_requirements(site) if site.exists() else None)\n"
            "print(json.dumps(info))\n")
    return run_check("environment", ["-c", code], 120, env, log)


def run_check(name: str, argv: list[str], timeout: float, env: dict, log) -> dict:
    """One check in its own process and work directory; its last stdout line, when JSON, is its result."""
    work = Path(tempfile.mkdtemp(prefix=f"pixrl-{name}-"))
    cmd = [sys.executable, *argv, *(["--workdir", str(work)] if argv[0] == SMOKE else [])]
    t0 = time.monotonic()
    log.write(f"\n===== {name}: {' '.join(cmd)}\n")
    log.flush()
    # its own process group: a check past its time is stopped with what it started (Prefect's API server)
    # Prefect's task lines (with times) in the log: a check stopped at its limit shows how far it got
    env = dict(env, PREFECT_LOGGING_LEVEL="INFO")
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    memory = GpuMemory()
    try:
        stdout, stderr = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        rc = "timeout"
    finally:
        memory.stop()
        shutil.rmtree(work, ignore_errors=True)  # the disk holds 64 GiB; a real-shapes model is tens of GB
    log.write(stdout + stderr)
    log.flush()
    res = {"check": name, "command": " ".join(argv[:4]), "rc": rc, "seconds": round(time.monotonic() - t0, 1)}
    if memory.peak_mib is not None:  # what the device held at most, seen from outside (also for a failed check)
        res["gpu_used_peak_gib"] = round(memory.peak_mib / 1024, 2)
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    try:
        res["result"] = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        res["tail"] = (stdout + stderr)[-1500:]
    return res


def kernel_failure(res: dict) -> bool:
    """A check that failed with a CUDA error other than running out of memory: CUDA reports such
    errors at a later call than the kernel that caused them (the FLUX.1 smoke's cuBLAS failure,
    2026-12-04), so a rerun with CUDA_LAUNCH_BLOCKING=1 is what names the kernel."""
    tail = res.get("tail", "")
    return res.get("rc") not in (0, "timeout") and "CUDA error" in tail and "out of memory" not in tail


class GpuMemory:
    """The GPU's used memory sampled once a second by `nvidia-smi` while a check runs: its peak,
    whatever way the check ends (PyTorch's own peak dies with a process that fails). No
    `nvidia-smi` (a CPU rehearsal): `peak_mib` stays None."""

    def __init__(self, every_s: float = 1.0):
        self.peak_mib: float | None = None
        self._stop = threading.Event()
        self._smi = shutil.which("nvidia-smi")
        self._thread = threading.Thread(target=self._poll, args=(every_s,), daemon=True)
        if self._smi:
            self._thread.start()

    def _poll(self, every_s: float) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run([self._smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout
                used = max(float(v) for v in out.split())
                self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)
            except (ValueError, OSError, subprocess.SubprocessError):
                pass
            self._stop.wait(every_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)


def record(out: Path, res: dict) -> None:
    with open(out / "checks.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")
    brief = res.get("result") or res.get("skipped") or res.get("tail", "")[-300:]
    print(f"[{res['check']}] rc={res.get('rc', '-')} {res.get('seconds', '')} s: {json.dumps(brief)[:600]}", flush=True)


if __name__ == "__main__":
    main()
