"""Carry pixrl's Python dependencies to the lent GPU machine, which reaches no package index.

The device machine (the `device` tool: one H200, Python 3.12, torch 2.11, numpy, pandas, pyarrow,
transformers …) lacks Prefect, MLflow, Lance, diffusers and their dependencies, and nothing can be
installed there from an index. One call carries at most 64 MiB, the working tree included — about
32 MiB of it is the tracked tree (the miniatures' weights) — while pylance's wheel alone is 81 MiB.
So the kit is the *unpacked* site tree of what the device lacks (the MLflow UI's bundle pruned),
one xz-compressed tar cut into parts that each fit one call beside the tree. The parts travel in
consecutive calls while the machine stays warm (30 s after each call); the call that brings the
last part installs the kit and runs the checks (`benchmarks/gpu_checks.py` does both ends).

Here, on a machine with PyPI (stdlib + pip):

    python3 benchmarks/device_kit.py lock            # re-resolve benchmarks/device_kit.lock (slow; when pins change)
    python3 benchmarks/device_kit.py build [--with video] [--with ray]   # .device_kit/partNN/, prints the calls

On the device (stdlib only; `gpu_checks.py` calls these):

    python3 benchmarks/device_kit.py receive         # move the carried part(s) to /tmp/pixrl-kit
    python3 benchmarks/device_kit.py install         # verify, unpack to /tmp/pixrl-site, check requirements

Why unpacked and xz: Python sources shrink about tenfold and pylance's 215 MB library to 48 MB,
against 81 MB as a wheel; installing is then a tar extraction (no pip, no index). Why not pip
`--target` on the device: it would need the wheels themselves there, which do not fit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = Path(__file__).with_name("device_kit.lock")
KIT_DIR = ROOT / ".device_kit"  # ignored by git; a part travels only when a call names it in `carry`
RECEIVED = Path(os.environ.get("PIXRL_KIT_PARTS", "/tmp/pixrl-kit"))
SITE = Path(os.environ.get("PIXRL_KIT_SITE", "/tmp/pixrl-site"))
CALL_LIMIT_MIB = 64  # the device tool's limit on what one call carries, the tree included
MARGIN_MIB = 2

DEVICE_PYTHON = "3.12"
DEVICE_TORCH = "2.11.0"  # what the device image holds (its CUDA wheels' dependencies are not all on PyPI's mirror here)
PLATFORMS = ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in (5, 12, 17, 24, 27, 28, 31, 34, 35)))
# Compiled and large packages the device image holds (its kinds page lists them); the kit carries
# everything else in the closure, so the device's versions of small pure-Python packages never matter.
DEVICE_PROVIDES = {
    "torch", "triton", "numpy", "scipy", "pandas", "pyarrow", "pillow", "sympy", "mpmath", "networkx",
    "matplotlib", "contourpy", "cycler", "fonttools", "kiwisolver", "scikit-learn", "joblib", "threadpoolctl",
    "jinja2", "markupsafe", "filelock", "fsspec", "pyyaml", "regex", "psutil", "packaging", "typing-extensions",
    "setuptools", "python-dateutil", "six",
}  # not tzdata: the H200 image lacks it (2026-12-04), and pendulum asks for it
DEVICE_PROVIDES_PREFIXES = ("nvidia-", "cuda-")
# Optional groups: the core kit runs gpu_smoke for the image families; video adds PyAV (Wan's
# clips), ray the Ray engine (benchmarks/scaling.py --device cuda).
# arrow: pixrl's own pyarrow, for a device whose pyarrow the requirement check refuses.
PROFILES = {"video": ["av==18.1.0"], "ray": ["ray==2.60.0"], "arrow": ["pyarrow==25.0.1"]}
# Declared by pixrl but never imported: its tables are read and written through pylance (`lance`).
NOT_CARRIED = {"lancedb"}
PRUNE = ("mlflow/server/js/",)  # the MLflow UI's bundle (40 MB unpacked): the device serves no UI


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    """The distribution a requirement string names ("ray[default]==2.60.0" → "ray")."""
    return canonical(re.split(r"[<>=!~\[ ;]", req)[0])


def provided_by_device(name: str) -> bool:
    n = canonical(name)
    return n in DEVICE_PROVIDES or n.startswith(DEVICE_PROVIDES_PREFIXES)


def project_requirements() -> list[str]:
    """pyproject's core dependencies but torch: the device brings its own, and resolving a CUDA torch
    for another Python pulls wheels this index may not have. Whether what was resolved accepts the
    device's torch is checked there (`install` lists any requirement it does not meet)."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    optional = {requirement_name(r) for reqs in PROFILES.values() for r in reqs}
    return [d for d in deps if requirement_name(d) not in {"torch", *NOT_CARRIED, *optional}]


def _pip_target_flags(python: str) -> list[str]:
    flags = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for p in PLATFORMS:
        flags += ["--platform", p]
    return flags


# ----------------------------------------------------------------------------------- lock (here)
def lock(python: str) -> None:
    """Resolve every requirement and every profile for the device's Python and torch; write the
    pins of what the device lacks to device_kit.lock (one section per profile)."""
    sections: dict[str, list[str]] = {}
    for profile, extra in [("core", []), *PROFILES.items()]:
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                            "--report", str(report), "--target", str(Path(tmp) / "t"), *_pip_target_flags(python),
                            *project_requirements(), *extra], check=True)
            pins = {canonical(i["metadata"]["name"]): i["metadata"]["version"]
                    for i in json.loads(report.read_text())["install"]}
        taken = {p.split("==")[0] for s in sections.values() for p in s}
        named = {requirement_name(r) for r in extra}  # a profile's own packages travel
        sections[profile] = sorted(f"{n}=={v}" for n, v in pins.items()
                                   if (n in named or not provided_by_device(n)) and n not in taken)
    lines = [f"# benchmarks/device_kit.py lock — Python {python} (device torch {DEVICE_TORCH}); what the device image lacks",
             "# (its own packages: DEVICE_PROVIDES in device_kit.py). Sections: [core] always, others by --with."]
    for profile, pins in sections.items():
        lines += [f"[{profile}]", *pins]
    LOCK.write_text("\n".join(lines) + "\n")
    print(f"wrote {LOCK}: " + ", ".join(f"{k} {len(v)}" for k, v in sections.items()))


def read_lock(profiles: list[str]) -> list[str]:
    pins, section = [], None
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        if section == "core" or section in profiles:
            pins.append(line)
    unknown = set(profiles) - set(PROFILES)
    if unknown:
        sys.exit(f"unknown profile(s) {sorted(unknown)}; choose from {sorted(PROFILES)}")
    return pins


# ---------------------------------------------------------------------------------- build (here)
def unpack_wheel(wheel: Path, site: Path, prune: tuple[str, ...] = PRUNE) -> None:
    """A wheel installed by hand: its files at the site root, `.data/purelib|platlib` merged in,
    scripts and headers left out (everything runs as `python -m`)."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            m = re.match(r"[^/]+\.data/(purelib|platlib|scripts|headers|data)/(.*)", name)
            if m:
                if m.group(1) not in ("purelib", "platlib"):
                    continue
                name = m.group(2)
            if not name or name.endswith("/") or name.startswith(prune):
                continue
            dest = site / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
            if info.external_attr >> 16 & 0o111:
                dest.chmod(0o755)


def tree_bytes() -> int:
    """What every call carries besides a part: tracked files and untracked files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file())


XZ_CHUNK = 96 * 2**20  # tar bytes per xz stream: streams compress in parallel, and the chunking
# is by size, not by core count, so the same tree gives the same archive on any machine


def compress_site(site: Path, archive: Path, chunk: int = XZ_CHUNK) -> str:
    """The site tree as one xz tar (sorted names, fixed metadata: the same tree gives the same
    bytes), its tar cut into `chunk`-byte pieces compressed as concatenated xz streams — one
    valid .xz file (readers decompress stream after stream) made on every core at once."""
    def clean(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        ti.mtime = 0
        return ti

    plain = archive.with_suffix(".plain")
    with tarfile.open(plain, mode="w") as tar:
        for path in sorted(site.rglob("*")):
            if path.is_file():
                tar.add(path, arcname=str(path.relative_to(site)), filter=clean)
    size = plain.stat().st_size
    spans = [(plain, lo, min(chunk, size - lo)) for lo in range(0, size, chunk)]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=min(len(spans), os.cpu_count() or 1)) as pool, open(archive, "wb") as out:
        for stream in pool.map(_xz_span, spans):  # in order
            out.write(stream)
    plain.unlink()
    return sha256(archive)


def _xz_span(span: tuple[Path, int, int]) -> bytes:
    path, offset, length = span
    with open(path, "rb") as f:
        f.seek(offset)
        return lzma.compress(f.read(length), preset=9 | lzma.PRESET_EXTREME)


def sha256(path: Path) -> str:
    """Hex digest of a file (here, not pixrl's: this module runs on the device before the kit is)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(archive: Path, out: Path, part_bytes: int, manifest: dict) -> list[Path]:
    """Cut the archive into part directories (`partNN/kit.NN` + the shared manifest)."""
    if out.exists():
        shutil.rmtree(out)
    parts, data_parts = [], []
    with open(archive, "rb") as f:
        for k, chunk in enumerate(iter(lambda: f.read(part_bytes), b""), start=1):
            d = out / f"part{k:02d}"
            d.mkdir(parents=True)
            (d / f"kit.{k:02d}").write_bytes(chunk)
            data_parts.append({"name": f"kit.{k:02d}", "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
            parts.append(d)
    manifest = {**manifest, "parts": data_parts}
    for d in parts:
        (d / "kit.json").write_text(json.dumps(manifest, indent=1))
    return parts


def build(profiles: list[str], python: str, wheels: Path, part_mib: float | None, out: Path = KIT_DIR) -> None:
    pins = read_lock(profiles)
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
                    *_pip_target_flags(python), *pins], check=True)
    tree = tree_bytes()
    budget = int((part_mib * 2**20) if part_mib else CALL_LIMIT_MIB * 2**20 - tree - MARGIN_MIB * 2**20)
    if budget < 4 * 2**20:
        sys.exit(f"the working tree is {tree / 2**20:.1f} MiB: under 4 MiB is left for a part of the "
                 f"{CALL_LIMIT_MIB} MiB a call carries; make the tree smaller (untracked files travel too)")
    chosen = _wheels_for(pins, wheels)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        for w in chosen:
            unpack_wheel(w, site)
        archive = Path(tmp) / "kit.tar.xz"
        digest = compress_site(site, archive)
        manifest = {"kit": digest, "python": python, "profiles": ["core", *profiles], "packages": pins,
                    "archive_bytes": archive.stat().st_size}
        parts = split(archive, out, budget, manifest)
    print(f"kit {digest[:12]}: {manifest['archive_bytes'] / 2**20:.1f} MiB of xz over {len(parts)} part(s) of at most "
          f"{budget / 2**20:.1f} MiB (the tree is {tree / 2**20:.1f} MiB of each call's {CALL_LIMIT_MIB})")
    print("device calls, one after another (each within 30 s of the last, or the machine goes back):")
    for d in parts:
        print(f'  run(command="PYTHONUNBUFFERED=1 python3 benchmarks/gpu_checks.py", '
              f'carry=["{os.path.relpath(d, ROOT)}"], timeout_s=600)')


def _wheels_for(pins: list[str], wheels: Path) -> list[Path]:
    """The downloaded wheel of each pin (fails naming a pin pip did not fetch)."""
    by_name = {}
    for w in wheels.glob("*.whl"):
        name, version = w.name.split("-")[:2]
        by_name[(canonical(name), version)] = w
    missing = [p for p in pins if (canonical(p.split("==")[0]), p.split("==")[1]) not in by_name]
    if missing:
        sys.exit(f"no wheel downloaded for {missing}: clear {wheels} and build again")
    return [by_name[(canonical(p.split("==")[0]), p.split("==")[1])] for p in pins]


# ------------------------------------------------------------------------------- receive (device)
def receive() -> tuple[dict | None, list[int]]:
    """Move the parts this call carried into RECEIVED (kept while the machine stays warm); the
    kit's manifest and the part numbers held so far. A part of another kit empties RECEIVED first."""
    RECEIVED.mkdir(parents=True, exist_ok=True)
    for d in sorted(KIT_DIR.glob("part*")):
        manifest = json.loads((d / "kit.json").read_text())
        held = RECEIVED / "kit.json"
        if held.exists() and json.loads(held.read_text())["kit"] != manifest["kit"]:
            shutil.rmtree(RECEIVED)
            RECEIVED.mkdir(parents=True)
        for f in d.glob("kit.[0-9]*"):
            shutil.move(str(f), RECEIVED / f.name)
        shutil.copy(d / "kit.json", held)
    if not (RECEIVED / "kit.json").exists():
        return None, []
    manifest = json.loads((RECEIVED / "kit.json").read_text())
    have = [k for k, p in enumerate(manifest["parts"], start=1) if (RECEIVED / p["name"]).exists()]
    return manifest, have


# ------------------------------------------------------------------------------- install (device)
def install(manifest: dict) -> Path:
    """Verify every part, then unpack the archive into SITE (a fresh directory renamed into place:
    complete or absent). Idempotent: an installed kit of the same digest is kept, so a later call
    on the same warm machine carries nothing and runs at once."""
    marker = SITE / ".pixrl-kit"
    if marker.exists() and marker.read_text() == manifest["kit"]:
        return SITE
    for p in manifest["parts"]:
        got = sha256(RECEIVED / p["name"])
        if got != p["sha256"]:
            raise SystemExit(f"kit part {p['name']} is damaged (sha256 {got[:12]}, expected {p['sha256'][:12]}): "
                             f"carry its part directory again")
    joined = RECEIVED / "kit.tar.xz"
    with open(joined, "wb") as out:
        for p in manifest["parts"]:
            with open(RECEIVED / p["name"], "rb") as f:
                shutil.copyfileobj(f, out)
    if sha256(joined) != manifest["kit"]:
        raise SystemExit("the joined kit does not match its manifest: rebuild it and carry every part again")
    SITE.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="pixrl-site-", dir=SITE.parent))
    with tarfile.open(joined, mode="r:xz") as tar:
        tar.extractall(staging, filter="data")
    joined.unlink()
    (staging / ".pixrl-kit").write_text(manifest["kit"])
    if SITE.exists():
        shutil.rmtree(SITE)
    staging.rename(SITE)
    return SITE


def check_requirements(site: Path) -> list[str]:
    """Each unpacked distribution's requirements (extras left out) against the versions this
    Python sees, the kit's first: the problems, one line each (empty when all hold)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    sys.path.insert(0, str(site))
    problems = []
    for dist_info in sorted(site.glob("*.dist-info")):
        dist = metadata.Distribution.at(dist_info)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{dist.metadata['Name']} needs {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{dist.metadata['Name']} needs {req}: this machine has {have}")
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    lk = sub.add_parser("lock")
    lk.add_argument("--python", default=DEVICE_PYTHON)
    b = sub.add_parser("build")
    b.add_argument("--with", dest="profiles", action="append", default=[], choices=sorted(PROFILES))
    b.add_argument("--python", default=DEVICE_PYTHON, help="the device's (a local check builds for this one's)")
    b.add_argument("--wheels", default=str(Path(tempfile.gettempdir()) / "pixrl-kit-wheels"))
    b.add_argument("--part-mib", type=float, default=None, help="default: what a call carries beside the tree")
    b.add_argument("--out", default=str(KIT_DIR), help="where the part directories go (default .device_kit)")
    sub.add_parser("receive")
    sub.add_parser("install")
    args = ap.parse_args()
    if args.cmd == "lock":
        lock(args.python)
    elif args.cmd == "build":
        build(args.profiles, args.python, Path(args.wheels) / args.python, args.part_mib, Path(args.out))
    else:
        manifest, have = receive()
        if manifest is None:
            sys.exit(f"no kit part here: build one (`python3 benchmarks/device_kit.py build`) and carry .device_kit/part01")
        print(f"kit {manifest['kit'][:12]}: parts {have} of {len(manifest['parts'])}")
        if args.cmd == "install":
            if len(have) < len(manifest["parts"]):
                sys.exit("kit incomplete: carry the missing parts first")
            site = install(manifest)
            problems = check_requirements(site)
            print(f"installed at {site}; requirements: " + ("all hold" if not problems else "\n  " + "\n  ".join(problems)))


if __name__ == "__main__":
    main()
