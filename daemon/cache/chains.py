"""Prefix chains: which cached entries can no longer be part of any hit.

Role
    Chunk keys form a tree per layout fingerprint: chunk i's key hashes chunk i-1's key, and each
    stored item names that parent key. The tracker keeps, per chunk key (a *node*), the READY
    entries stored under it (group -> kind) and the parent/child links, and reports *orphans*:
    entries that the hybrid hit rule can no longer use, so that the ``hybrid`` eviction policy
    evicts them first.

    A node is *intact* when it holds every full-attention group's entry, and *complete* when it
    holds every Mamba group's state. A hit of n chunks needs intact nodes for chunks [0, n) and,
    for an engine with Mamba groups, a complete node at chunk n-1.

    - **Prefix gone.** When a node stops being intact, every other entry under it and every entry
      under its descendants is an orphan.
    - **States gone.** When a node stops being complete, its remaining Mamba states are orphans.
    - **No state left below.** For an engine with Mamba groups, a node *supports* hits while it is
      intact and it, or a supporting child, is complete. When a node stops supporting, its
      attention entries are orphans. ``live_children`` counts the supporting children, so a change
      walks up only through the nodes whose support changes. A node that starts supporting again
      reports its attention entries as *revived*.

    Attention chunks stored before the state that will make them useful are not marked on
    insertion (that state is usually a step behind); entries are only reported on a transition.
    Orphans are a hint for eviction order, never a correctness input: a lookup still checks every
    entry it serves.

    Pure bookkeeping with no I/O and no clock; the index calls it when entries become READY and
    when they leave.

Threading
    Event-loop only (called by ``daemon/cache/index.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

EntryKey = tuple[bytes, int, bytes]  # (fingerprint, group_id, chunk_key), as in daemon/cache/index.py
NodeKey = tuple[bytes, bytes]  # (fingerprint, chunk_key)
Groups = tuple[frozenset[int], frozenset[int]]  # (full-attention group ids, Mamba group ids)

ATTENTION_KINDS = ("full", "swa")


@dataclass(slots=True)
class _Node:
    parent: bytes = b""  # parent chunk key; b"" for chunk 0 or not known yet
    children: set[bytes] | None = None  # created with the first child (most chunks have one or none)
    groups: dict[int, str] = field(default_factory=dict)  # READY entries here: group_id -> kind
    live_children: int = 0  # children that support hits


@dataclass(slots=True)
class ChainChange:
    """What one add or remove changed: entry keys to mark as orphans, and keys to unmark."""

    orphans: list[EntryKey] = field(default_factory=list)
    revived: list[EntryKey] = field(default_factory=list)


class ChainTracker:
    def __init__(self, groups_of: Callable[[bytes], Groups]) -> None:
        self._groups_of = groups_of
        self._nodes: dict[NodeKey, _Node] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    # ---- node predicates -----------------------------------------------------------------------
    def _intact(self, fp: bytes, node: _Node) -> bool:
        return all(g in node.groups for g in self._groups_of(fp)[0])

    def _complete(self, fp: bytes, node: _Node) -> bool:
        mamba = self._groups_of(fp)[1]
        return bool(mamba) and all(g in node.groups for g in mamba)

    def _supports(self, fp: bytes, node: _Node) -> bool:
        if not self._groups_of(fp)[1]:
            return False  # attention-only engine: every intact prefix is a hit, nothing to count
        return self._intact(fp, node) and (node.live_children > 0 or self._complete(fp, node))

    # ---- entries -------------------------------------------------------------------------------
    def add(self, key: EntryKey, kind: str, parent: bytes) -> ChainChange:
        fp, gid, ck = key
        change = ChainChange()
        node = self._node(fp, ck)
        if gid in node.groups:
            return change
        if parent and not node.parent:
            node.parent = parent
            pnode = self._node(fp, parent)
            if pnode.children is None:
                pnode.children = set()
            pnode.children.add(ck)
            if self._supports(fp, node):
                self._propagate(fp, parent, pnode, +1, change)
        before = self._supports(fp, node)
        node.groups[gid] = kind
        self._changed(fp, ck, node, before, change)
        return change

    def remove(self, key: EntryKey, kind: str) -> ChainChange:
        fp, gid, ck = key
        change = ChainChange()
        node = self._nodes.get((fp, ck))
        if node is None or gid not in node.groups:
            return change
        before = self._supports(fp, node)
        was_intact, was_complete = self._intact(fp, node), self._complete(fp, node)
        del node.groups[gid]
        if was_intact and not self._intact(fp, node):
            change.orphans.extend((fp, g, ck) for g in node.groups)
            for child in node.children or ():
                self._collect_subtree(fp, child, change.orphans)
        elif was_complete and not self._complete(fp, node):
            change.orphans.extend((fp, g, ck) for g, k in node.groups.items() if k == "mamba")
        self._changed(fp, ck, node, before, change)
        self._prune(fp, ck, node)
        return change

    # ---- tree maintenance ----------------------------------------------------------------------
    def _node(self, fp: bytes, ck: bytes) -> _Node:
        node = self._nodes.get((fp, ck))
        if node is None:
            node = self._nodes[(fp, ck)] = _Node()
        return node

    def _changed(self, fp: bytes, ck: bytes, node: _Node, before: bool, change: ChainChange) -> None:
        """``node``'s own entries changed; report and propagate a change in whether it supports hits."""
        now = self._supports(fp, node)
        if now == before:
            return
        self._report(fp, ck, node, now, change)
        if node.parent:
            self._propagate(fp, node.parent, self._nodes[(fp, node.parent)], +1 if now else -1, change)

    def _propagate(self, fp: bytes, ck: bytes, node: _Node, delta: int, change: ChainChange) -> None:
        # One child started (+1) or stopped (-1) supporting hits; walk up while support changes.
        while True:
            before = self._supports(fp, node)
            node.live_children += delta
            now = self._supports(fp, node)
            if now == before:
                return
            self._report(fp, ck, node, now, change)
            if not node.parent:
                return
            ck = node.parent
            node = self._nodes[(fp, ck)]

    @staticmethod
    def _report(fp: bytes, ck: bytes, node: _Node, supports: bool, change: ChainChange) -> None:
        out = change.revived if supports else change.orphans
        out.extend((fp, g, ck) for g, k in node.groups.items() if k in ATTENTION_KINDS)

    def _collect_subtree(self, fp: bytes, root: bytes, out: list[EntryKey]) -> None:
        stack = [root]
        while stack:
            ck = stack.pop()
            node = self._nodes.get((fp, ck))
            if node is None:
                continue
            out.extend((fp, g, ck) for g in node.groups)
            stack.extend(node.children or ())

    def _prune(self, fp: bytes, ck: bytes, node: _Node) -> None:
        # Drop nodes that hold nothing and lead nowhere, walking up through emptied parents.
        while not node.groups and not node.children:
            del self._nodes[(fp, ck)]
            if not node.parent:
                return
            parent = self._nodes.get((fp, node.parent))
            if parent is None:
                return
            if parent.children is not None:
                parent.children.discard(ck)
                if not parent.children:
                    parent.children = None
            ck, node = node.parent, parent
