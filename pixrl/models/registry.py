"""Family name → implementation. A new family registers itself with @register_family."""

from __future__ import annotations

from typing import Callable

_FAMILIES: dict[str, type] = {}


class UnknownFamilyError(KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def register_family(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        cls.name = name
        _FAMILIES[name] = cls
        return cls

    return deco


def registered_families() -> list[str]:
    _import_builtin()
    return sorted(_FAMILIES)


def get_family(name: str) -> type:
    _import_builtin()
    if name not in _FAMILIES:
        raise UnknownFamilyError(
            f"unknown model family {name!r}; registered families: {', '.join(sorted(_FAMILIES))}")
    return _FAMILIES[name]


def _import_builtin() -> None:
    from . import sd3  # noqa: F401  (registers "sd3")
