"""Where a llama.cpp target's cache entries sit, and the rule that keeps replies exact.

llama.cpp keeps one unified KV cache of `cells`; each cell holds one token's keys and
values, its position and the set of sequence ids it belongs to. A token attends to
the cells of its first sequence id up to its own position, and its attention (the
flash-attention kernel, one row at a time: llama_target.py says why that one) sums
those cells **in cell order**, skipping the rest. Floating-point sums depend on their
order, so a row gives the bits of the reference (the same conversation decoded alone
from an empty cache, where cells fill in position order) only if every sequence's
cells lie in position order. Measured on SmolLM2: one 1-token pass after a tree whose
rejected cells were reused for the next tokens was off by up to 0.9 in the logits.

llama.cpp's allocator fills the free cells it finds scanning up from its `head`, and
frees move `head` back to the lowest freed cell. So the rule kept here is: **no free
cell below an occupied one** (the occupied cells are always 0..top-1). Then every
pass's rows land at top, top+1, ... in the order they are given, after every cell any
sequence holds, and each sequence's cells stay in position order.

Cells nobody reads any more (a tree's rejected branches, a dropped request) are freed
at once only where they are the cache's topmost cells; elsewhere they become
*garbage*: they stay occupied under a sequence id no token ever names, masked for
everyone (the kernel skips masked cells, so they cost a mask entry each). When
garbage would crowd out a pass, `compact` rewrites the cache without it, in the same
order, through llama.cpp's own state save and restore (whole-cache restore puts the
saved cells at 0, 1, 2, ...).

`CellLedger` mirrors the cells' positions and sequence sets for the operations the
target uses (it never reads llama.cpp's own table), so the target knows where each
row lands and which sequences hold which cells.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from typing import Any


class CellLedger:
    """A mirror of llama.cpp's KV cell table for the cells' owners: per occupied cell,
    its position and the sequences that hold it; the free cells are always `top`,
    `top`+1, ... (see the module).

    It mirrors what decides whether a cell is free. A tree's sequences also join the
    cells of their request's prefix (llama_memory_seq_cp, so that the tree sees it),
    which the ledger does not record: the prefix's own sequence holds those cells for
    as long as the tree lives, and removing a tree sequence never frees them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pos: list[int] = []
        """Per cell below `top`: the position of the token it holds."""
        self.owners: list[int] = []
        """Per cell below `top`: how many sequences hold it (0: free)."""
        self.members: dict[int, list[int]] = {}
        """Per sequence: the cells it holds, in cell order."""

    @property
    def top(self) -> int:
        """Cells 0..top-1 are occupied; the next row lands at `top`."""
        return len(self.pos)

    @property
    def free(self) -> int:
        return self.capacity - self.top

    def append(self, positions: Iterable[int], seq_sets: Iterable[Iterable[int]]) -> range:
        """Rows decoded at the top, in order: the cells they now occupy."""
        start = self.top
        for p, seqs in zip(positions, seq_sets):
            cell = len(self.pos)
            self.pos.append(int(p))
            seqs = set(seqs)
            self.owners.append(len(seqs))
            for s in seqs:
                self.members.setdefault(s, []).append(cell)
        if self.top > self.capacity:
            raise RuntimeError(f"{self.top - self.capacity} cells past the cache's {self.capacity}")
        return range(start, self.top)

    def cells_of(self, seq: int) -> list[int]:
        """The cells holding `seq`, in cell order."""
        return list(self.members.get(seq, ()))

    def positions_of(self, seq: int) -> list[int]:
        return [self.pos[c] for c in self.members.get(seq, ())]

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """llama_memory_seq_cp: every cell of `src` with p0 <= pos < p1 joins `dst`."""
        have = set(self.members.get(dst, ()))
        new = [c for c in self._cells_in(src, p0, p1) if c not in have]
        if not new:
            return
        for c in new:
            self.owners[c] += 1
        self.members[dst] = sorted(have.union(new))

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> list[int]:
        """llama_memory_seq_rm: `seq` leaves its cells with p0 <= pos < p1; returns the
        cells that no sequence holds any more (llama.cpp frees them)."""
        leaving = self._cells_in(seq, p0, p1)
        if not leaving:
            return []
        gone = set(leaving)
        kept = [c for c in self.members[seq] if c not in gone]
        if kept:
            self.members[seq] = kept
        else:
            del self.members[seq]
        emptied = []
        for c in leaving:
            self.owners[c] -= 1
            if not self.owners[c]:
                emptied.append(c)
        return emptied

    def holes(self) -> list[int]:
        """Free cells below the top: what the rule forbids (`trim` removes those at the top)."""
        return [c for c, n in enumerate(self.owners) if not n]

    def trim(self) -> None:
        """Drop the free cells at the top (llama.cpp's `head` moves down to them)."""
        while self.owners and not self.owners[-1]:
            self.pos.pop()
            self.owners.pop()

    def compacted(self) -> None:
        """The cache was saved and restored whole: the occupied cells, in their order,
        now sit at 0, 1, 2, ..."""
        new_index: dict[int, int] = {}
        for c, n in enumerate(self.owners):
            if n:
                new_index[c] = len(new_index)
        self.pos = [self.pos[c] for c in new_index]
        self.owners = [self.owners[c] for c in new_index]
        self.members = {s: [new_index[c] for c in cells] for s, cells in self.members.items()}

    def in_position_order(self, seq: int) -> bool:
        """Whether `seq`'s cells lie in strictly increasing position order (what keeps
        its rows exact)."""
        positions = self.positions_of(seq)
        return all(a < b for a, b in zip(positions, positions[1:]))

    def _cells_in(self, seq: int, p0: int, p1: int) -> list[int]:
        cells = self.members.get(seq, [])
        if p0 < 0 and p1 < 0:
            return list(cells)
        hi = p1 if p1 >= 0 else 1 << 62
        return [c for c in cells if p0 <= self.pos[c] < hi]


class KVCache:
    """A llama.cpp context's KV cells kept by the rule above: every change to which
    sequences hold which cells goes through here, to llama.cpp and to the ledger alike."""

    def __init__(self, lib: Any, ctx: Any, *, garbage_seq: int) -> None:
        self.lib, self.ctx = lib, ctx
        self.mem = lib.llama_get_memory(ctx)
        self.ledger = CellLedger(int(lib.llama_n_ctx(ctx)))
        self.GARBAGE = garbage_seq
        """The sequence that holds garbage: no token ever names it, so nobody sees it."""
        self.compactions = 0

    def cp(self, src: int, dst: int, p0: int = -1, p1: int = -1, *, mirror: bool = True) -> None:
        """llama_memory_seq_cp; `mirror=False` for a tree sequence joining its prefix (see
        CellLedger)."""
        self.lib.llama_memory_seq_cp(self.mem, src, dst, p0, p1)
        if mirror:
            self.ledger.seq_cp(src, dst, p0, p1)

    def rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """llama_memory_seq_rm, as it is: for cells that stay held, or free at the top."""
        self.lib.llama_memory_seq_rm(self.mem, seq, p0, p1)
        self.ledger.seq_rm(seq, p0, p1)
        self.ledger.trim()

    def release(self, seq: int, p0: int = -1) -> None:
        """`seq` leaves its cells at positions >= p0; the cells nobody else holds become
        free where they are the cache's top cells, else garbage."""
        owners, pos = self.ledger.owners, self.ledger.pos
        alone = [c for c in self.ledger.cells_of(seq) if owners[c] == 1 and pos[c] >= max(p0, 0)]
        if alone and not self.at_top(alone):
            self.cp(seq, self.GARBAGE, p0)
        self.rm(seq, p0)

    def drop(self, leaving: list[int], seqs: Sequence[int], base: int) -> None:
        """Remove a tree's sequences; `leaving`, the cells nobody keeps, become free where
        they are the top ones, else garbage (the tree's cells lie at positions >= `base`)."""
        if leaving and not self.at_top(leaving):
            for seq in seqs:
                self.cp(seq, self.GARBAGE, base)
        for seq in seqs:
            self.rm(seq)

    def at_top(self, cells: list[int]) -> bool:
        """Whether `cells` (about to be freed) lie above every cell that stays occupied."""
        leaving = set(cells)
        owners = self.ledger.owners
        c = self.ledger.top - 1
        while c >= 0 and (c in leaving or not owners[c]):
            c -= 1
        return min(leaving) > c

    def garbage(self) -> int:
        """Cells only the garbage sequence holds."""
        owners = self.ledger.owners
        return sum(1 for c in self.ledger.cells_of(self.GARBAGE) if owners[c] == 1)

    def compact(self) -> None:
        """Free the garbage and rewrite the cache without it, in the same order: llama.cpp's
        whole-state save and restore puts the saved cells at 0, 1, 2, ... (a copy of the
        cache's used part, once per compaction)."""
        if not self.ledger.cells_of(self.GARBAGE):
            return
        self.lib.llama_memory_seq_rm(self.mem, self.GARBAGE, -1, -1)  # holes for a moment: rewritten below
        self.ledger.seq_rm(self.GARBAGE)
        lib = self.lib
        size = lib.llama_state_get_size(self.ctx)
        buf = (ctypes.c_uint8 * size)()
        written = lib.llama_state_get_data(self.ctx, buf, size)
        if lib.llama_state_set_data(self.ctx, buf, written) != written:
            raise RuntimeError("llama.cpp could not restore the target's cache while compacting it")
        self.ledger.compacted()
        self.compactions += 1
