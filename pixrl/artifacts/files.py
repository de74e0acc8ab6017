"""Small files written whole or not at all: write beside the target, then rename over it."""

from __future__ import annotations

import json
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json_atomic(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj))
