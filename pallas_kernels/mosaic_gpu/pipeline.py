"""Persistent CTAs over a flat list of tiles, with the next tile's copies in flight.

A one-tile-per-CTA kernel waits for its copies before any work and leaves the memory
system idle while it computes, unless enough other CTAs share the SM. Here each CTA (grid
axis "p", P programs) serves chunks `p, p + P, p + 2P, ...` of `CHUNK` consecutive tiles
(b slowest) from two stages of shared buffers: the copies of tile n + 1 into one stage
are issued before tile n is computed from the other. Within a chunk the row's slot,
cursor and mode, and the q and k its tiles share, are mostly L1 hits; dealing the chunks
round robin spreads each row's tiles over many CTAs, so rows that flush (twice the work)
do not pile onto a few CTAs when cursors are staggered.

The stages are separate buffers addressed with a static stage index (the loop is unrolled
by two). Mosaic aligns each buffer to 1 KiB, as TMA needs; a stage axis inside one buffer,
indexed dynamically, would place a small buffer's second stage at an unaligned address.
"""

from __future__ import annotations

from collections.abc import Callable

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

STAGES = 2
CHUNK = 4  # tiles: GDN's two value heads per key head at d_v = 128
SMEM_PER_SM = 228 * 1024  # Hopper: one SM's shared memory, 1 KiB of it reserved per CTA
_CTA_RESERVED = 1024


def programs_that_fit(cta_smem_bytes: int, sm_count: int, num_tiles: int) -> int:
    """Persistent CTAs to launch: as many per SM as shared memory holds (at least one),
    never more than there are tiles."""
    per_sm = max(1, SMEM_PER_SM // (cta_smem_bytes + _CTA_RESERVED))
    return max(1, min(num_tiles, per_sm * sm_count))


def tile_grid(batch: int, heads: int, tiles: int, num_programs: int) -> dict:
    """`plgpu.kernel`'s grid arguments for `serve_tiles`: one CTA per tile ("b", "ht"), or
    `num_programs` persistent CTAs ("p")."""
    if num_programs:
        return dict(grid=(num_programs,), grid_names=("p",))
    return dict(grid=(batch, heads * tiles), grid_names=("b", "ht"))


def serve_tiles(batch: int, heads: int, tiles: int, num_programs: int, issue: Callable, compute: Callable) -> None:
    """Serve tile t of head h of row b for every `(b, h, t)`: `issue(b, h, t, stage)`
    starts its copies into a stage of shared buffers, `compute(b, h, t, stage)` waits for
    them and works. One CTA per tile (`num_programs = 0`), or `persistent_tiles` over the
    tiles numbered with b slowest; the kernel's grid is `tile_grid`'s."""
    per_row = heads * tiles
    where = lambda index: (index // per_row, index % per_row // tiles, index % tiles)
    if num_programs:
        persistent_tiles(batch * per_row, num_programs, lambda index, stage: issue(*where(index), stage),
                         lambda index, stage: compute(*where(index), stage))
        return
    b, ht = lax.axis_index("b"), lax.axis_index("ht")
    issue(b, ht // tiles, ht % tiles, 0)
    compute(b, ht // tiles, ht % tiles, 0)
    plgpu.wait_smem_to_gmem(0)


def chunk_size(num_tiles: int, num_programs: int) -> int:
    """`CHUNK`, or fewer tiles per chunk where that many would leave programs idle."""
    return max(1, min(CHUNK, num_tiles // num_programs))


def program_tiles(program, num_tiles: int, num_programs: int):
    """`(tile_of, count)`: program p of P serves its n-th tile `tile_of(n)`, n < count, the
    chunks `p, p + P, ...` of `chunk_size` tiles each (the last chunk of the N tiles may
    be short; count >= 1 when P <= N)."""
    chunk = chunk_size(num_tiles, num_programs)
    num_chunks = -(-num_tiles // chunk)
    mine = (num_chunks - program + num_programs - 1) // num_programs  # >= 1: P <= num_chunks
    last = program + (mine - 1) * num_programs
    count = (mine - 1) * chunk + lax.min(chunk, num_tiles - last * chunk)
    return (lambda n: (program + n // chunk * num_programs) * chunk + n % chunk), count


def persistent_tiles(num_tiles: int, num_programs: int, issue: Callable, compute: Callable) -> None:
    """Run `issue(tile, stage)` (start tile's copies into `stage`) one tile ahead of
    `compute(tile, stage)` (wait for them, work, start its stores) over this CTA's tiles
    (`program_tiles`).

    Before a stage is refilled, every thread has finished the tile it held (a warpgroup
    barrier) and every store but the newest has finished reading shared memory, so
    `compute` must issue a tile's stores from the stage's tile buffer before its small
    output store (the one left in flight, from a buffer the refill does not touch)."""
    tile_of, count = program_tiles(lax.axis_index("p"), num_tiles, num_programs)  # count >= 1
    issue(tile_of(0), 0)

    def stage_pair(i, carry):
        for stage in range(STAGES):
            n = STAGES * i + stage

            @pl.when(n < count)
            def _serve():
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                plgpu.commit_smem()  # also a warpgroup barrier: tile n - 1 is done with its stage

                @pl.when(n + 1 < count)
                def _prefetch():
                    issue(tile_of(n + 1), (stage + 1) % STAGES)

                compute(tile_of(n), stage)

        return carry

    lax.fori_loop(0, (count + STAGES - 1) // STAGES, stage_pair, None)
    plgpu.wait_smem_to_gmem(0)
