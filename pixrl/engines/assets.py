"""Embedded assets (the miniature's checkpoint, the shapes prompt sets) behind `builtin:` paths."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

BUILTIN = "builtin:"


def assets_dir() -> Path:
    return Path(str(resources.files("pixrl") / "assets"))


def resolve_asset(path: str) -> Path:
    if path.startswith(BUILTIN):
        p = assets_dir() / path[len(BUILTIN):]
        if not p.exists():
            available = sorted(str(q.relative_to(assets_dir())) for q in assets_dir().rglob("*")
                               if q.is_file() and q.suffix in (".parquet", ".json"))
            raise FileNotFoundError(f"embedded asset {path!r} is missing from this install "
                                    f"(available: {', '.join(available) or 'none'})")
        return p
    return Path(path).expanduser()


def resolve_model_path(path: str) -> Path:
    if path == "???" or not path:
        raise FileNotFoundError("model.path is not set; pass model.path=/path/to/a/diffusers/checkout")
    return resolve_asset(path)
