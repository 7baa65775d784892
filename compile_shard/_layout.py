"""The padded layout shared by the runtime, the ops and the passes.

Every rank holds ``padded_rows`` rows of each parameter (the last ranks fewer real
ones, zero padding after them), so every rank's shard has the same size and the
all-gather output and the reduce-scatter input are rank-major blocks of equal size.
"""

from __future__ import annotations


def padded_rows(rows: int, world_size: int) -> int:
    """Rows of dim 0 each rank holds: ``ceil(rows / world_size)``."""
    return -(-rows // world_size)
