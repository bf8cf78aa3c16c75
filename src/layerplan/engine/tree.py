"""The shape of a token tree checked in one pass (SpecInfer-style tree verification).

A pass over a tree runs its nodes as one chunk, in index order: node i sits at position
start + depth(i) and attends to the cached prefix, its ancestors and itself. Its KV entry is
written at slot position start + i; after verification the cache keeps the accepted path only
(KVCache.compact moves its entries to start, start + 1, ...). A chain is the tree whose every
node's parent is the node before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class TreeShape:
    """parents[i]: index of node i's parent in the pass, -1 for a child of the last cached token.
    Nodes come in an order where every parent precedes its children."""

    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.parents:
            raise ValueError("a token tree needs at least one node")
        for i, parent in enumerate(self.parents):
            if not isinstance(parent, int) or not -1 <= parent < i:
                raise ValueError(f"node {i} of a token tree has parent {parent!r}; a parent is -1 or an earlier node")

    @classmethod
    def chain(cls, length: int) -> TreeShape:
        return cls(tuple(range(-1, length - 1)))

    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """0 for the children of the cached prefix."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(0 if parent < 0 else depths[parent] + 1)
        return tuple(depths)

    @cached_property
    def ancestors(self) -> np.ndarray:
        """(n, n) bool: [i, j] where node j is node i or one of its ancestors."""
        n = len(self.parents)
        mask = np.zeros((n, n), dtype=bool)
        for i, parent in enumerate(self.parents):
            mask[i, i] = True
            if parent >= 0:
                mask[i] |= mask[parent]
        return mask

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def children(self, node: int) -> list[int]:
        """Nodes whose parent is `node` (-1: the roots), in index order."""
        return [i for i, parent in enumerate(self.parents) if parent == node]
