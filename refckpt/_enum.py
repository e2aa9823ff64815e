"""``StrEnum``: an enum of strings whose ``str()`` is its value (``enum.StrEnum`` from Python 3.11,
here for 3.10 too). Protocol steps, step states and the harness's vocabularies are such enums, so
they print, compare and serialise as the plain strings they stand for."""

from __future__ import annotations

import enum

__all__ = ["StrEnum"]


class StrEnum(str, enum.Enum):
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
