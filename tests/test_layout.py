"""The layout the stage-layer issue asks for, kept: no module over 400 lines and no function
over 60 (small files with one job), and models/algorithms/rewards never import Prefect."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pixrl"
MODULES = sorted(PACKAGE.rglob("*.py"))


def _rel(p: Path) -> str:
    return str(p.relative_to(PACKAGE.parent))


def test_the_package_is_found():
    assert len(MODULES) > 50 and (PACKAGE / "stages" / "online.py") in MODULES


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_no_module_over_400_lines_and_no_function_over_60(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 400, f"{_rel(path)} has {len(text.splitlines())} lines; split it by job"
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60]
    assert not long, f"{_rel(path)}: functions over 60 lines {long}"


@pytest.mark.parametrize("folder", ["models", "algorithms", "rewards"])
def test_compute_folders_never_import_prefect(folder):
    bad = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [n.module or ""] if isinstance(n, ast.ImportFrom) else []
            bad += [f"{_rel(path)}:{n.lineno}" for m in names if m.split(".")[0] == "prefect"]
    assert not bad, f"Prefect imported in {folder}/: {bad}"
