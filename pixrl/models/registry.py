"""Family name → implementation. A new family registers itself with @register_family."""

from __future__ import annotations

from ..config.registry import Registry, UnknownNameError


def _builtin() -> None:
    from . import flux, qwen_image, sd3  # noqa: F401  (register "flux1", "qwen_image", "sd3")


FAMILIES: Registry[type] = Registry("model family", "families", _builtin)
register_family = FAMILIES.register
get_family = FAMILIES.get
registered_families = FAMILIES.names
UnknownFamilyError = UnknownNameError
