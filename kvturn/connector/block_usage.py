"""Which KV blocks of a decode engine are in use, seen from the scheduler-side connector
(plain Python, no vLLM import).

The connector has no handle on vLLM's block pool, so it counts what it can see: the blocks of
every request the scheduler allocated or scheduled (from ``update_state_after_alloc`` and each
step's ``SchedulerOutput``) and the blocks its leases hold. A block shared by several requests
(prefix cache) counts once. Blocks of finished requests that vLLM frees go back to the free pool,
prefix-cached or not (vLLM evicts cached blocks on demand), so they count as free.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

BlockIds = Sequence[Sequence[int]]


class BlockUsage:
    """Reference counts of the blocks running requests and leases hold, per KV cache group."""

    def __init__(self, num_blocks: int):
        #: Usable blocks per group (vLLM keeps block 0 as its null block).
        self.num_blocks = max(0, num_blocks - 1)
        self._refs: list[Counter[int]] = []
        self._owned: dict[str, tuple[list[int], ...]] = {}

    def set_blocks(self, owner: str, block_ids: BlockIds) -> None:
        """``owner`` (a request or a lease) now holds exactly ``block_ids``."""
        self.drop(owner)
        blocks = tuple(list(group) for group in block_ids)
        self._owned[owner] = blocks
        self._count(blocks, +1)

    def add_blocks(self, owner: str, block_ids: BlockIds) -> None:
        """``owner`` holds ``block_ids`` on top of what it held."""
        held = self._owned.get(owner)
        if held is None:
            self.set_blocks(owner, block_ids)
            return
        extra = tuple(list(group) for group in block_ids)
        while len(held) < len(extra):
            held = (*held, [])
        self._owned[owner] = (
            tuple(h + e for h, e in zip(held, extra, strict=False)) + held[len(extra) :]
        )
        self._count(extra, +1)

    def drop(self, owner: str) -> None:
        blocks = self._owned.pop(owner, None)
        if blocks is not None:
            self._count(blocks, -1)

    def drop_all(self, owners: Iterable[str]) -> None:
        for owner in owners:
            self.drop(owner)

    def holds(self, owner: str) -> bool:
        return owner in self._owned

    def used(self) -> int:
        """Blocks in use in the fullest group."""
        return max((len(refs) for refs in self._refs), default=0)

    def free(self) -> int:
        return max(0, self.num_blocks - self.used())

    def _count(self, blocks: tuple[list[int], ...], sign: int) -> None:
        while len(self._refs) < len(blocks):
            self._refs.append(Counter())
        for refs, group in zip(self._refs, blocks, strict=False):
            for block in group:
                if block == 0:
                    continue
                count = refs[block] + sign
                if count > 0:
                    refs[block] = count
                else:
                    del refs[block]


def local_turn_blocks(
    num_tokens: int, num_computed_tokens: int, block_size: int, leased: bool
) -> int:
    """Free blocks a waiting decode-local turn draws on: the blocks its prefix cache does not
    cover, and, once its conversation's lease has ended, the covered ones too.

    A live lease keeps the hit blocks referenced, so reusing them takes nothing from vLLM's
    free pool. Once the lease lapsed they sit in that pool as cached blocks, and the prefix hit
    takes them from it like new ones. Asking only for the uncovered blocks then undercounts the
    turn's need: measured on the agent trace (``benchmarks/trace_replay.py --preset agent``,
    learned leases), the connector saw 12 free blocks against an ask of 3, reclaimed nothing,
    and the turn waited up to 22 s, until other leases lapsed on their own."""
    need = num_tokens if not leased else num_tokens - num_computed_tokens
    return -(-max(0, need) // block_size)
