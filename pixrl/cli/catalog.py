"""`pixrl list`: what this installation can run — the registered model families, algorithms and
rewards (each with the first line of its docstring) and the presets (each with the first line of
its header comment) — so a user finds `--config NAME` and `model.family=NAME` without reading
the source."""

from __future__ import annotations

import inspect
import json
import sys

import typer
from rich.console import Console
from rich.markup import escape

from .app import _fail, app

KINDS = ("families", "algorithms", "rewards", "experiments", "presets")


def _doc_line(obj) -> str:
    """The first line of the class's own docstring (not one it inherits), else of its module's."""
    doc = inspect.cleandoc(obj.__dict__.get("__doc__") or "") or inspect.getdoc(sys.modules.get(obj.__module__)) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def _comment_line(group: str, name: str) -> str:
    """The first comment line of a preset file (what it is and where its numbers come from)."""
    from ..config.loader import presets_dir

    for line in (presets_dir() / group / f"{name}.yaml").read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def catalog(kind: str) -> dict[str, str]:
    """name → one line, for one kind of thing."""
    if kind == "families":
        from ..models.registry import get_family, registered_families

        return {n: _doc_line(get_family(n)) for n in registered_families()}
    if kind == "algorithms":
        from ..algorithms.base import ALGORITHMS

        return {n: _doc_line(ALGORITHMS.get(n)) for n in ALGORITHMS.names()}
    if kind == "rewards":
        from ..rewards.base import REWARDS

        return {n: _doc_line(REWARDS.get(n)) for n in REWARDS.names()}
    from ..config.loader import GROUPS, available_presets

    groups = ["experiment"] if kind == "experiments" else list(GROUPS)
    return {(n if kind == "experiments" else f"{g}/{n}"): _comment_line(g, n)
            for g in groups for n in available_presets(g)}


@app.command(name="list")
def list_cmd(
    kind: str = typer.Argument("experiments", help=f"one of: {', '.join(KINDS)}"),
    as_json: bool = typer.Option(False, "--json", help="a JSON object name → description"),
) -> None:
    """List what can be run: model families (model.family=…), algorithms (algorithm=…), rewards
    (reward.weights keys), experiment presets (--config …) or every preset group."""
    if kind not in KINDS:
        _fail(f"pixrl list {kind!r}: choose one of {', '.join(KINDS)}")
    items = catalog(kind)
    if as_json:
        print(json.dumps(items))
        return
    width, out = max(map(len, items), default=0), Console(soft_wrap=True)  # the listing is the output: stdout
    for name, line in items.items():
        out.print(f"[bold]{escape(name.ljust(width))}[/bold]  {escape(line)}", highlight=False, soft_wrap=True)
