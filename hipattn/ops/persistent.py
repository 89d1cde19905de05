"""The grid of a persistent kernel, whose blocks walk equal work items in a fixed stride (blockIdx.x,
+ gridDim.x, ...): the decode attention on Hopper and the warp-specialised flash forward."""

from __future__ import annotations


def persistent_blocks(items: int, slots: int) -> int:
    """The persistent grid for ``items`` equal work items on ``slots`` block slots: as many rounds as a
    full grid takes, and the fewest blocks that still finish in them, so that every block walks the
    same number of items (give or take one). A full grid would leave the items of the last round to a
    few blocks while the rest sit idle, and a few blocks cannot keep the memory system busy: 4,096
    items on 264 slots are 16 items for 136 blocks and 15 for 128, where 256 blocks take 16 each."""
    rounds = -(-items // slots)
    return -(-items // rounds)
