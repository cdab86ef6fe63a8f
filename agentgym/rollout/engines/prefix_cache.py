"""Radix prefix cache: keys and values of token-id prefixes, for one policy version.

The keys and values at position ``i`` of a causal LM depend only on tokens ``0..i`` (and
the weights), so any cached sequence that shares its first ``m`` tokens with a new
request supplies that request's first ``m`` positions. The tree stores each token once:
an edge holds a run of token ids and the per-layer keys/values of exactly those
positions; a request that extends a cached sequence (the next turn of a trajectory) or
repeats a prompt (the n samples of a GRPO group) finds its longest cached prefix by
walking the tree (SGLang's RadixCache, on CPU tensors or any device).

Budget: ``max_tokens`` positions in all. When an insert goes over, least recently used
leaves are evicted first (a leaf's parent becomes a leaf once its children are gone).
Nothing in the tree is ever referenced from outside: callers copy what they read
(:meth:`gather`), so every entry may be evicted. A weight update must :meth:`clear` the
tree, since keys and values of one policy are wrong for the next.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

#: (first position, end position) -> per-layer keys and values of those positions, as one
#: tensor of shape (layers, 2, kv_heads, end - first, head_dim)
KVSource = Callable[[int, int], torch.Tensor]


class _Node:
    __slots__ = ("key", "kv", "children", "parent", "last_used")

    def __init__(self, key: tuple[int, ...], kv: torch.Tensor | None, parent: _Node | None,
                 last_used: int) -> None:
        self.key, self.kv, self.parent, self.last_used = key, kv, parent, last_used
        self.children: dict[int, _Node] = {}


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):
        return n
    return next(i for i in range(n) if a[i] != b[i])


class PrefixCache:
    """A radix tree of token ids and their keys/values, at most ``max_tokens`` positions."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"engine.cache_tokens={max_tokens}; must be >= 1")
        self.max_tokens = max_tokens
        self._clock = itertools.count(1)
        self.root = _Node((), None, None, 0)
        self.tokens = 0
        self.stats = {"lookups": 0, "hit_tokens": 0, "inserted_tokens": 0,
                      "evicted_tokens": 0, "clears": 0}

    # -- reading ------------------------------------------------------------------------
    def match(self, ids: Sequence[int], limit: int | None = None) -> list[tuple[_Node, int]]:
        """The path of the longest cached prefix of ``ids[:limit]``: (node, positions used)
        pairs, root excluded. Touches the nodes (least recently used is evicted first)."""
        ids = tuple(ids if limit is None else ids[:limit])
        self.stats["lookups"] += 1
        now, node, pos, path = next(self._clock), self.root, 0, []
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            used = _common(child.key, ids[pos:pos + len(child.key)])
            child.last_used = now
            path.append((child, used))
            pos += used
            if used < len(child.key):
                break
            node = child
        self.stats["hit_tokens"] += pos
        return path

    @staticmethod
    def length(path: list[tuple[_Node, int]]) -> int:
        return sum(used for _, used in path)

    @staticmethod
    def gather(path: list[tuple[_Node, int]]) -> torch.Tensor | None:
        """Keys and values along ``path``: (layers, 2, kv_heads, length, head_dim), a copy
        (None for an empty path)."""
        if not path:
            return None
        parts = [node.kv[:, :, :, :used] for node, used in path]
        return torch.cat(parts, dim=3) if len(parts) > 1 else parts[0].clone()

    # -- writing ------------------------------------------------------------------------
    def insert(self, ids: Sequence[int], kv: KVSource) -> int:
        """Cache ``ids``; ``kv(a, b)`` gives the keys/values of positions ``a..b-1`` and is
        asked only for the part not cached yet. Returns the number of new positions."""
        ids = tuple(ids)
        now, node, pos = next(self._clock), self.root, 0
        while pos < len(ids):
            node.last_used = now
            child = node.children.get(ids[pos])
            if child is None:
                break
            used = _common(child.key, ids[pos:pos + len(child.key)])
            if used < len(child.key):
                child = self._split(child, used)
            child.last_used = now
            node, pos = child, pos + used
        if pos == len(ids):
            return 0
        tail = kv(pos, len(ids)).clone(memory_format=torch.contiguous_format)  # off the pool
        if tail.shape[3] != len(ids) - pos:
            raise ValueError(f"kv({pos}, {len(ids)}) gave {tail.shape[3]} positions")
        leaf = _Node(ids[pos:], tail, node, now)
        node.children[ids[pos]] = leaf
        new = len(ids) - pos
        self.tokens += new
        self.stats["inserted_tokens"] += new
        self._evict()
        return new

    def clear(self) -> None:
        """Drop everything (a new policy version)."""
        self.root.children.clear()
        self.tokens = 0
        self.stats["clears"] += 1

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge after ``at`` tokens; return the new upper node."""
        upper = _Node(child.key[:at], child.kv[:, :, :, :at].clone(), child.parent,
                      child.last_used)
        child.parent.children[child.key[0]] = upper
        child.key, child.kv = child.key[at:], child.kv[:, :, :, at:].clone()
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def _evict(self) -> None:
        """Least recently used leaves out until within budget. An insert touches its whole
        path, so the newest entry goes last (and only if it alone is over budget)."""
        if self.tokens <= self.max_tokens:
            return
        leaves = sorted((n for n in self._nodes() if not n.children), key=lambda n: n.last_used)
        while self.tokens > self.max_tokens and leaves:
            leaf = leaves.pop(0)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.tokens -= len(leaf.key)
            self.stats["evicted_tokens"] += len(leaf.key)
            if parent is not self.root and not parent.children:  # a leaf now, in LRU order
                at = next((i for i, n in enumerate(leaves) if n.last_used > parent.last_used),
                          len(leaves))
                leaves.insert(at, parent)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
