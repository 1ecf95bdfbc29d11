"""`EventLog`: the last events of a kind and how many there were in all; what a long-running actor
keeps instead of a list that grows with every swap, publish or verdict."""
from __future__ import annotations

from collections import deque
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class EventLog(Generic[T]):
    def __init__(self, keep: int = 256):
        self.items: deque[T] = deque(maxlen=keep)
        self.total = 0  # events ever appended (the kept ones are the last `keep`)

    def append(self, item: T) -> None:
        self.items.append(item)
        self.total += 1

    def since(self, seen: int) -> list[T]:
        """The events after the first `seen` (those still kept)."""
        new = min(self.total - seen, len(self.items))
        return list(self.items)[len(self.items) - new:] if new > 0 else []

    def last(self, n: int) -> list[T]:
        return list(self.items)[-n:] if n > 0 else []

    def __iter__(self) -> Iterator[T]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index):
        return list(self.items)[index] if isinstance(index, slice) else self.items[index]
