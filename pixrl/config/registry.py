"""One small registry type for every pluggable kind (model families, rewards, algorithms):
a decorator to register under a name, and a lookup whose error lists what is registered."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from ..errors import ExpectedError

T = TypeVar("T")


class UnknownNameError(ExpectedError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class Registry(Generic[T]):
    def __init__(self, kind: str, plural: str, load_builtin: Callable[[], None]):
        self.kind, self.plural = kind, plural
        self._items: dict[str, T] = {}
        self._load_builtin = load_builtin

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            obj.name = name
            self._items[name] = obj
            return obj

        return deco

    def names(self) -> list[str]:
        self._load_builtin()
        return sorted(self._items)

    def get(self, name: str) -> T:
        self._load_builtin()
        if name not in self._items:
            raise UnknownNameError(f"unknown {self.kind} {name!r}; registered {self.plural}: {', '.join(sorted(self._items))}")
        return self._items[name]
