"""Family name → implementation. A new family registers itself with @register_family."""

from __future__ import annotations

from ..config.registry import Registry, UnknownNameError


def _builtin() -> None:
    from . import flux, flux2, janus, qwen_image, sana, sd3, wan  # noqa: F401  (register each family by its name)


FAMILIES: Registry[type] = Registry("model family", "families", _builtin)
register_family = FAMILIES.register
get_family = FAMILIES.get
registered_families = FAMILIES.names
UnknownFamilyError = UnknownNameError
