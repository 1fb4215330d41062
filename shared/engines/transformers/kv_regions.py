"""Where sessions' KV caches sit on a pool's token axis: a buddy allocator in slabs.

The axis [0, total) is cut into slabs of the longest context. A session starts in the smallest
block and grows into larger ones - in place when the room after it is free - up to a whole slab,
so short sessions hold short blocks while the pool still holds ``total // slab`` sessions at
their longest. Blocks are contiguous, so attention reads a session's cache as a view.
"""

from __future__ import annotations


class Regions:
    """Blocks of the token axis [0, total): ``total // slab`` slabs of ``slab`` tokens (the
    longest context) each. A slab is split buddy-fashion into blocks of ``smallest * 2**order``
    tokens (orders 0 .. ``power``, a freed block merging with its free buddy), or - when the slab
    is no such power - handed out whole as order ``top`` = ``power + 1``."""

    def __init__(self, total: int, smallest: int, slab: int) -> None:
        self.smallest, self.slab = smallest, slab
        self.power = max((slab // smallest).bit_length() - 1, 0)
        self.top = self.power + (slab != smallest << self.power)
        self.layout: list[tuple[int, int]] = []  # (offset, order) of a fresh slab's blocks
        offset = 0
        for order in range(self.power, -1, -1):  # the slab in ever smaller blocks
            if offset + self.size(order) <= slab:
                self.layout.append((offset, order))
                offset += self.size(order)
        self.slabs = max(total // slab, 1)
        self.total = self.slabs * slab
        self.free: list[set[int]] = [set() for _ in range(self.power + 1)]
        for s in range(self.slabs):
            for offset, order in self.layout:
                self.free[order].add(s * slab + offset)

    def size(self, order: int) -> int:
        return self.slab if order > self.power else self.smallest << order

    def order_for(self, tokens: int) -> int | None:
        return next((o for o in range(self.top + 1) if self.size(o) >= tokens), None)

    @property
    def free_tokens(self) -> int:
        return sum(len(bases) * self.size(o) for o, bases in enumerate(self.free))

    def _slab_free(self, first: int) -> bool:
        return all(first + offset in self.free[order] for offset, order in self.layout)

    def allocate(self, order: int) -> int | None:
        if order > self.power:  # a whole slab
            first = next((s * self.slab for s in range(self.slabs)
                          if self._slab_free(s * self.slab)), None)
            if first is not None:
                self.take(first, order)
            return first
        found = next((o for o in range(order, self.power + 1) if self.free[o]), None)
        if found is None:
            return None
        base = min(self.free[found])  # the smallest block that fits, lowest first
        self.free[found].remove(base)
        while found > order:  # split: keep the lower half, free the upper
            found -= 1
            self.free[found].add(base + self.size(found))
        return base

    def grow(self, base: int, order: int, wanted: int) -> bool:
        """Extend the block at ``base`` in place to order ``wanted`` by claiming the free room
        after it; False (nothing claimed) when some of it is taken."""
        if wanted > self.power:  # the whole slab: everything else in it must be free
            first = base - base % self.slab
            self.release(base, order)
            if self._slab_free(first):
                self.take(first, wanted)
                return True
            self.take(base, order)
            return False
        buddies = []
        for o in range(order, wanted):
            offset = base % self.slab
            if offset % self.size(o + 1) or base + self.size(o) not in self.free[o]:
                return False
            buddies.append((o, base + self.size(o)))
        for o, buddy in buddies:
            self.free[o].remove(buddy)
        return True

    def take(self, base: int, order: int) -> None:
        """Claim the block at ``base`` of ``order``, free itself or inside a free larger one
        (one just released, taken back)."""
        first = base - base % self.slab
        if order > self.power:
            if base != first or not self._slab_free(first):
                raise ValueError(f"slab {base} is not free")
            for offset, o in self.layout:
                self.free[o].remove(first + offset)
            return
        for o in range(order, self.power + 1):
            outer = first + (base - first) // self.size(o) * self.size(o)
            if outer in self.free[o]:
                self.free[o].remove(outer)
                while o > order:  # split down to the block, freeing the halves beside it
                    o -= 1
                    upper = outer + self.size(o)
                    self.free[o].add(outer if base >= upper else upper)
                    outer = upper if base >= upper else outer
                return
        raise ValueError(f"block {base} of order {order} is not free")

    def release(self, base: int, order: int) -> None:
        first = base - base % self.slab
        if order > self.power:
            for offset, o in self.layout:
                self.free[o].add(first + offset)
            return
        while order < self.power:
            buddy = first + ((base - first) ^ self.size(order))
            if buddy not in self.free[order]:
                break
            self.free[order].remove(buddy)
            base, order = min(base, buddy), order + 1
        self.free[order].add(base)
