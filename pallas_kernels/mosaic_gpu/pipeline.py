"""A persistent, double-buffered loop over tiles for the Mosaic GPU kernels.

Each CTA (grid axis "p", P programs) serves tiles `p, p + P, p + 2P, ...`. Its shared-memory
buffers come in two stages: while it computes tile n from stage n % 2, the copies of tile
n + 1 into the other stage are already in flight, so a CTA overlaps its own loads with its
work instead of waiting for every tile's copies before starting on it.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

STAGES = 2


def persistent_tiles(num_tiles: int, num_programs: int, issue, compute) -> None:
    """Run `issue(tile, stage)` (start the tile's copies into `stage`) one tile ahead of
    `compute(tile, stage)` (wait for them, work, start the tile's stores), over this CTA's
    tiles. Before a stage is refilled every thread has finished with it and the stores
    issued from it have finished reading shared memory."""
    program = lax.axis_index("p")
    count = jnp.maximum(num_tiles - program + num_programs - 1, 0) // num_programs

    @pl.when(count > 0)
    def _first():
        issue(program, 0)

    def step(i, carry):
        tile = program + i * num_programs
        stage = i % STAGES

        @pl.when(i + 1 < count)
        def _next():
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.commit_smem()  # also a warpgroup barrier: tile i - 1 is done with the stage
            issue(tile + num_programs, 1 - stage)

        compute(tile, stage)
        return carry

    lax.fori_loop(0, count, step, None)
    plgpu.wait_smem_to_gmem(0)
