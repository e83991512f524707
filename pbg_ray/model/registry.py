"""Components picked by name: one small registry type for operators, comparators, losses
and regularizers."""

from __future__ import annotations

from typing import Callable, Dict, Generic, Tuple, TypeVar

from pbg_ray.errors import PbgRayError, did_you_mean

T = TypeVar("T")


class Registry(Generic[T]):
    """name -> class, filled by the `register` decorator (PyKEEN/PBG style)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._classes: Dict[str, type] = {}

    def register(self, name: str) -> Callable[[type], type]:
        def decorate(cls: type) -> type:
            self._classes[name] = cls
            cls.name = name
            return cls
        return decorate

    def names(self) -> Tuple[str, ...]:
        return tuple(self._classes)

    def get(self, name: str) -> type:
        try:
            return self._classes[name]
        except KeyError:
            raise PbgRayError(f"unknown {self.what} {name!r}{did_you_mean(name, self._classes)}. "
                              f"Valid values: {', '.join(self._classes)}.") from None
