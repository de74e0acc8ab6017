"""benchmarks/device_kit.py and gpu_checks.py: pixrl's dependencies travel to the GPU machine as
parts of one xz tar, one part per call; the call that completes the kit installs it whole and
runs the checks. Real wheels (built here in the wheel format), real tar/xz, real subprocesses."""

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def kit(tmp_path, monkeypatch):
    mod = _load("device_kit")
    monkeypatch.setattr(mod, "KIT_DIR", tmp_path / "repo" / ".device_kit")
    monkeypatch.setattr(mod, "RECEIVED", tmp_path / "received")
    monkeypatch.setattr(mod, "SITE", tmp_path / "site")
    return mod


def _wheel(dirpath: Path, name: str, payload: bytes, requires: list[str] = ()) -> Path:
    """A wheel as pip builds one: the package, a `.data/purelib` file, a script, dist-info."""
    dist = f"{name}-1.0"
    w = dirpath / f"{name}-1.0-py3-none-any.whl"
    meta = "Metadata-Version: 2.1\nName: " + name + "\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(w, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{name}/__init__.py", f"BLOB = {payload!r}\n")
        z.writestr(f"{dist}.data/purelib/{name}_extra.py", "VALUE = 7\n")
        z.writestr(f"{dist}.data/scripts/{name}-cli", "#!python\n")
        z.writestr(f"{name}/server/js/bundle.js", "x" * 100)
        z.writestr(f"{dist}.dist-info/METADATA", meta)
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return w


def _build(kit, tmp_path, part_bytes, requires=()):
    import os

    site = tmp_path / "build-site"
    blob = os.urandom(150_000)  # incompressible: several parts
    kit.unpack_wheel(_wheel(tmp_path, "kitpkg", blob, requires), site, prune=("kitpkg/server/js/",))
    archive = tmp_path / "kit.tar.xz"
    digest = kit.compress_site(site, archive, chunk=40_000)  # several xz streams, as a large kit has
    parts = kit.split(archive, kit.KIT_DIR, part_bytes, {"kit": digest, "profiles": ["core"], "packages": []})
    return parts, blob


def test_wheel_unpacks_as_installed_and_prunes(kit, tmp_path):
    site = tmp_path / "s"
    kit.unpack_wheel(_wheel(tmp_path, "kitpkg", b"abc"), site, prune=("kitpkg/server/js/",))
    assert (site / "kitpkg" / "__init__.py").exists() and (site / "kitpkg_extra.py").read_text() == "VALUE = 7\n"
    assert (site / "kitpkg-1.0.dist-info" / "METADATA").exists()
    assert not list(site.rglob("*cli")) and not (site / "kitpkg" / "server").exists()


def test_parts_travel_one_per_call_and_install_whole(kit, tmp_path):
    parts, blob = _build(kit, tmp_path, part_bytes=60_000)
    assert len(parts) >= 3 and all((p / "kit.json").exists() for p in parts)
    assert all(f.stat().st_size <= 60_000 for p in parts for f in p.glob("kit.[0-9]*"))
    staged = {p.name: list(p.iterdir()) for p in parts}
    import shutil

    shutil.move(str(kit.KIT_DIR), tmp_path / "all-parts")  # each call carries one part directory
    for k, p in enumerate(parts, start=1):
        shutil.copytree(tmp_path / "all-parts" / p.name, kit.KIT_DIR / p.name)
        manifest, have = kit.receive()
        shutil.rmtree(kit.KIT_DIR)
        assert have == list(range(1, k + 1)) and len(staged[p.name]) == 2
    site = kit.install(manifest)
    out = subprocess.run([sys.executable, "-c", "import kitpkg, kitpkg_extra; print(len(kitpkg.BLOB), kitpkg_extra.VALUE)"],
                         cwd=tmp_path, env={"PYTHONPATH": str(site)}, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(len(blob)), "7"]
    assert kit.install(manifest) == site  # installed already: kept


def test_damaged_part_is_refused_and_nothing_installed(kit, tmp_path):
    parts, _ = _build(kit, tmp_path, part_bytes=60_000)
    manifest, have = kit.receive()
    assert have == list(range(1, len(parts) + 1))
    victim = kit.RECEIVED / "kit.02"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="kit part kit.02 is damaged.*carry its part directory again"):
        kit.install(manifest)
    assert not kit.SITE.exists()


def test_a_part_of_another_kit_replaces_the_old_one(kit, tmp_path):
    _build(kit, tmp_path, part_bytes=60_000)
    kit.receive()
    first = json.loads((kit.RECEIVED / "kit.json").read_text())["kit"]
    again = tmp_path / "again"
    again.mkdir()
    _build(kit, again, part_bytes=400_000)
    manifest, have = kit.receive()
    assert manifest["kit"] != first and have == [1]
    assert sorted(f.name for f in kit.RECEIVED.glob("kit.[0-9]*")) == ["kit.01"]


def test_requirements_are_checked_against_this_python(kit, tmp_path):
    site = tmp_path / "s"
    kit.unpack_wheel(_wheel(tmp_path, "kitpkg", b"a", ["pytest>=1", "no-such-dist-pixrl>=1", "pytest<1",
                                                      'other-missing; extra == "x"']), site)
    problems = kit.check_requirements(site)
    assert problems == ["kitpkg needs no-such-dist-pixrl>=1: not installed",
                        f"kitpkg needs pytest<1: this machine has {pytest.__version__}"]


def test_lock_sections_and_carried_set():
    kit = _load("device_kit")
    core = kit.read_lock([])
    names = {kit.canonical(p.split("==")[0]) for p in core}
    assert {"prefect", "mlflow", "pylance", "diffusers", "transformers", "peft", "omegaconf", "pydantic"} <= names
    assert not names & {"torch", "numpy", "pyarrow", "lancedb", "av", "ray"}  # the device's, never imported, profiles
    assert {"av"} <= {kit.canonical(p.split("==")[0]) for p in kit.read_lock(["video"])}
    with pytest.raises(SystemExit, match="unknown profile"):
        kit.read_lock(["nope"])


def test_checks_wait_for_the_whole_kit_then_run(kit, tmp_path, monkeypatch):
    """gpu_checks.py: a call that leaves parts missing stores its part and names the next; the
    call that completes the kit installs it and runs the environment check with it on the path."""
    import shutil

    parts, _ = _build(kit, tmp_path, part_bytes=60_000)
    shutil.move(str(kit.KIT_DIR), tmp_path / "all-parts")
    checks = _load("gpu_checks")
    monkeypatch.setattr(checks, "device_kit", kit)
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setattr(sys, "argv", ["gpu_checks.py", "--only", "environment", "--device", "cpu"])
    for k, p in enumerate(parts, start=1):
        if kit.KIT_DIR.exists():
            shutil.rmtree(kit.KIT_DIR)
        shutil.copytree(tmp_path / "all-parts" / p.name, kit.KIT_DIR / p.name)  # this call's carry
        checks.main()
        assert out.exists() == (k == len(parts))  # nothing runs before the kit is whole
    lines = [json.loads(x) for x in (out / "checks.jsonl").read_text().splitlines()]
    assert [x["check"] for x in lines] == ["environment"] and lines[0]["rc"] == 0, lines
    env = lines[0]["result"]
    assert env["kit_problems"] is not None and env["versions"]["prefect"]


def test_checks_shrink_to_tiny_models_for_the_cpu_path():
    from argparse import Namespace

    checks = _load("gpu_checks")
    cpu = Namespace(tiny=True, device="cpu")
    assert checks._adapt(["benchmarks/gpu_smoke.py", "--family", "flux2", "--layers", "2"], cpu) == \
        ["benchmarks/gpu_smoke.py", "--family", "flux2", "--tiny", "--steps", "4", "--device", "cpu"]
    gpu = Namespace(tiny=False, device="cuda")
    assert checks._adapt(["benchmarks/gpu_smoke.py", "--family", "qwen_image", "--layers", "20"], gpu)[-4:] == \
        ["--layers", "20", "--device", "cuda"]
    assert checks._adapt(checks.CHECKS["scaling"][0], gpu) == checks.CHECKS["scaling"][0]
    full = Namespace(tiny=False, device="cuda", full_depth=True)
    assert checks._adapt(["benchmarks/gpu_smoke.py", "--family", "flux1", "--layers", "8"], full) == \
        ["benchmarks/gpu_smoke.py", "--family", "flux1", "--device", "cuda"]


def test_a_check_past_its_time_is_stopped_with_what_it_started(tmp_path):
    """A check that overruns is killed with its process group (a smoke's Prefect API server too),
    and the record says timeout."""
    import io
    import os
    import time

    checks = _load("gpu_checks")
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(120)\n")
    t0 = time.monotonic()
    res = checks.run_check("sleeper", ["-c", code], 3, dict(os.environ), io.StringIO())
    assert res["rc"] == "timeout" and time.monotonic() - t0 < 30
    grandchild = int(res["result"])  # its last line: the pid it printed
    time.sleep(0.5)
    stat = Path(f"/proc/{grandchild}/stat")  # gone, or a zombie nobody has reaped yet: not running
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_a_checks_gpu_memory_peak_is_kept_whatever_way_it_ends(tmp_path, monkeypatch):
    """The GPU's used memory is sampled while a check runs and its peak recorded, also for a check
    that fails; without `nvidia-smi` (this machine) nothing is recorded. The device's `nvidia-smi`
    is stood in for by a script answering as it does (one line per GPU, MiB, no header), each call
    the next reading."""
    import io
    import os

    checks = _load("gpu_checks")
    res = checks.run_check("plain", ["-c", "raise SystemExit(3)"], 30, dict(os.environ), io.StringIO())
    assert res["rc"] == 3 and "gpu_used_peak_gib" not in res
    readings = tmp_path / "readings"
    readings.write_text("1024\n98304\n2048\n")
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\nhead -n1 %s; sed -i 1d %s\n" % (readings, readings))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    res = checks.run_check("failing", ["-c", "import time; time.sleep(4); raise SystemExit(1)"], 30,
                           dict(os.environ), io.StringIO())
    assert res["rc"] == 1 and res["gpu_used_peak_gib"] == 96.0


def test_a_cuda_kernel_failure_is_rerun_with_synchronous_launches_then_cublaslt(tmp_path, monkeypatch, capsys):
    """A check failing with a CUDA error other than out-of-memory is run once more after the others
    with CUDA_LAUNCH_BLOCKING=1, which names the failing kernel, and when that still fails in
    cuBLAS, with TORCH_BLAS_PREFER_CUBLASLT=1; an out-of-memory one is not rerun."""
    checks = _load("gpu_checks")
    cublas = "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx(...)`"
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 630.00 MiB"
    assert checks.kernel_failure({"rc": 1, "tail": cublas})
    assert not checks.kernel_failure({"rc": 1, "tail": oom + " CUDA error"})
    assert not checks.kernel_failure({"rc": 0, "result": {}}) and not checks.kernel_failure({"rc": "timeout", "tail": cublas})
    code = ("import os, sys\n"
            "print('blocking=' + os.environ.get('CUDA_LAUNCH_BLOCKING', '0'))\n"
            f"sys.exit({cublas!r}) if os.environ.get('CUDA_LAUNCH_BLOCKING') != '1' else print('{{}}')\n")
    # fails in cuBLAS whatever the launches, and passes on cuBLASLt's path
    gemm = ("import os, sys\n"
            f"sys.exit({cublas!r}) if os.environ.get('TORCH_BLAS_PREFER_CUBLASLT') != '1' else print('{{}}')\n")
    monkeypatch.setattr(checks, "CHECKS", {"gemm": (["-c", code], 30, None), "lt": (["-c", gemm], 30, None)})
    monkeypatch.setattr(checks, "environment", lambda env, log: {"check": "environment", "rc": 0})
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["gpu_checks.py", "--no-kit"])
    checks.main()
    lines = [json.loads(ln) for ln in (tmp_path / "checks.jsonl").read_text().splitlines()]
    assert [ln["check"] for ln in lines] == ["environment", "gemm", "lt", "gemm+blocking", "lt+blocking",
                                             "lt+cublaslt"]
    assert lines[1]["rc"] == 1 and "CUBLAS_STATUS_EXECUTION_FAILED" in lines[1]["tail"]
    assert lines[3]["rc"] == 0  # the blocking rerun passed: no cuBLASLt rerun for it
    assert lines[4]["rc"] == 1 and lines[5]["rc"] == 0


def test_the_archive_is_the_same_bytes_for_the_same_tree_and_one_valid_xz(kit, tmp_path):
    import lzma
    import os
    import tarfile

    site = tmp_path / "s"
    kit.unpack_wheel(_wheel(tmp_path, "kitpkg", os.urandom(100_000)), site)
    a, b = tmp_path / "a.tar.xz", tmp_path / "b.tar.xz"
    assert kit.compress_site(site, a, chunk=30_000) == kit.compress_site(site, b, chunk=30_000)
    assert a.read_bytes().count(b"\xfd7zXZ\x00") >= 4  # one xz stream per 30 kB of tar
    with tarfile.open(a, mode="r:xz") as tar:
        assert sorted(tar.getnames()) == sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())
    assert len(lzma.decompress(a.read_bytes())) % 512 == 0  # the whole tar, stream after stream
