"""Persistent CTAs over a flat list of tiles, with the next tile's copies in flight.

A one-tile-per-CTA kernel waits for its copies before any work and leaves the memory
system idle while it computes, unless enough other CTAs share the SM. Here each CTA (grid
axis "p", P programs) serves chunks `p, p + P, p + 2P, ...` of consecutive tiles (b
slowest; a chunk is one head group's tiles, at most `MAX_CHUNK`) from two stages of shared
buffers: the copies of tile n + 1 into one stage are issued before tile n is computed from
the other. Dealing the chunks round robin spreads each row's tiles over many CTAs, so rows
that flush (twice the work) do not pile onto a few CTAs when cursors are staggered.

Head groups: the heads `h` with one `h // group_size` (GDN's value heads of one key head,
Mamba-2's heads of one B/C group) read the same key-side records and token vectors. A
tile is *fresh* when the CTA's previous tile belonged to another row or group; the kernel
computes the group's shared values (e.g. `K k`, `K q`) on fresh tiles only, keeps them in
shared memory, and reads them back on the group's other tiles.

Group copies (`issue_group`, KDA): records only a group's fresh tile reads (its key and
decay records) go into one buffer, not one per stage: the copy for the CTA's next fresh
tile starts when the current tile calls its `prefetch` (after the group's values are
computed from the buffer), so it overlaps the rest of this tile and, with two or more
tiles per group, the group's other tiles.

The stages are separate buffers addressed with a static stage index (the loop is unrolled
by two). Mosaic aligns each buffer to 1 KiB, as TMA needs; a stage axis inside one buffer,
indexed dynamically, would place a small buffer's second stage at an unaligned address.

Registers: every shared-memory address and `wgmma` descriptor of those buffers is the same
on every tile, so the compiler computes them once before the loop and holds them across it
(about 200 of a GDN decode kernel's 255 registers per thread, which leaves two CTAs
resident per SM). `with_program_axis` / `program_view` give a kernel buffers it indexes by
a per-tile zero the compiler cannot prove (`opaque_zero`), so each tile recomputes them.

Warpgroups: a CTA of `warpgroups` > 1 warpgroups runs that many programs side by side
(`plgpu.kernel(num_threads=...)`; program `p * warpgroups + wg`), each on its own slice of
every buffer and barrier (`with_program_axis(scratch, warpgroups)`, viewed at `wg`). It is
the one way Mosaic GPU offers to give ptxas a register budget: a 384-thread CTA gets at
most 168 registers per thread, the budget of three resident 128-thread CTAs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import check_row_order
from pallas_kernels.mosaic_gpu.layouts import SMEM_LIMIT, smem_bytes

STAGES = 2
# Where one program's slice of a buffer starts (`with_program_axis`): TMA writes shared
# memory at 128-byte aligned addresses, and a 128-byte swizzle repeats every 1 KiB.
TMA_ALIGN = 128
SWIZZLED_ALIGN = 1024
# Tiles per chunk at most: longer chunks share a group's values over more tiles but balance
# rows that flush (twice the work) worse over the CTAs when cursors are staggered.
MAX_CHUNK = 4
SMEM_PER_SM = 228 * 1024  # Hopper: one SM's shared memory, 1 KiB of it reserved per CTA
_CTA_RESERVED = 1024


def ctas_per_sm(cta_smem_bytes: int, max_ctas: int | None = None) -> int:
    """Persistent CTAs of `cta_smem_bytes` resident on one SM: as many as its shared memory
    holds, at most `max_ctas` (a kernel's register bound, its `RESIDENT_CTAS`: an SM's
    65,536 registers hold two 128-thread CTAs of more than 168 registers per thread, and
    persistent programs past the resident ones wait for whole CTAs to finish), at least
    one."""
    fit = SMEM_PER_SM // (cta_smem_bytes + _CTA_RESERVED)
    return max(1, fit if max_ctas is None else min(fit, max_ctas))


def grouped_fits_more(scratch_of) -> bool:
    """Whether a kernel's shared buffers with its key-side records grouped
    (`scratch_of(True)`: one buffer per CTA, a group copy) fit more persistent CTAs per SM
    in shared memory than with them copied into every stage (`scratch_of(False)`)."""
    return ctas_per_sm(smem_bytes(scratch_of(True))) > ctas_per_sm(smem_bytes(scratch_of(False)))


def programs_that_fit(cta_smem_bytes: int, sm_count: int, num_tiles: int, max_ctas: int | None = None,
                      warpgroups: int = 1) -> int:
    """Persistent programs to launch: as many CTAs per SM as are resident (`ctas_per_sm`),
    never more programs than there are tiles. With `warpgroups` w > 1 (CTAs of w programs,
    `cta_smem_bytes` their buffers together), one CTA per SM, since its threads may take all
    the registers, and w programs each; 0 where the CTA does not fit or there are fewer
    tiles than w."""
    if warpgroups == 1:
        return max(1, min(num_tiles, ctas_per_sm(cta_smem_bytes, max_ctas) * sm_count))
    if cta_smem_bytes > SMEM_LIMIT or num_tiles < warpgroups:
        return 0
    return max(1, min(num_tiles // warpgroups, sm_count)) * warpgroups


def tile_grid(batch: int, heads: int, tiles: int, num_programs: int, warpgroups: int = 1) -> dict:
    """`plgpu.kernel`'s grid arguments for `serve_tiles`: one CTA per tile ("b", "ht"), or
    `num_programs` persistent programs ("p"), `warpgroups` of them per CTA (threads "wg";
    `num_programs` a multiple of it)."""
    if not num_programs:
        return dict(grid=(batch, heads * tiles), grid_names=("b", "ht"))
    if warpgroups == 1:
        return dict(grid=(num_programs,), grid_names=("p",))
    return dict(grid=(num_programs // warpgroups,), grid_names=("p",), num_threads=warpgroups, thread_name="wg")


def program_index(warpgroups: int = 1):
    """This persistent program's index: its CTA's, times `warpgroups`, plus its warpgroup's."""
    if warpgroups == 1:
        return lax.axis_index("p")
    return lax.axis_index("p") * warpgroups + lax.axis_index("wg")


def program_slot(warpgroups: int = 1):
    """The slice of `with_program_axis(scratch, warpgroups)` this program owns: its warpgroup."""
    return 0 if warpgroups == 1 else lax.axis_index("wg")


def with_program_axis(scratch, programs: int = 1):
    """`scratch` (nested lists of `plgpu.SMEM` buffers, `plgpu.RefUnion`s and barriers) with
    a leading axis of `programs` on every buffer (a union's members each), for
    `program_view`. With one program the bytes and the alignment are `scratch`'s and the
    barriers are left as they are; with more, every barrier array also gets the axis, and a
    union only where its members are single buffers of equal bytes per program (as
    `rebuild.stacked_operands` makes them): members of other sizes would be laid out at
    different strides, so one program's smaller member would overlap another program's
    larger one. A barrier array's programs are laid end to end on its one axis
    (`BarrierRange`), and a buffer's first axis is padded so that each program's slice
    starts where TMA may write (`padded_rows`)."""
    if isinstance(scratch, (list, tuple)):
        return [with_program_axis(item, programs) for item in scratch]
    if isinstance(scratch, plgpu.Barrier):
        if programs == 1:
            return scratch
        if len(scratch.num_barriers) > 1:
            raise ValueError(f"barrier arrays of one axis only, got shape {scratch.num_barriers}")
        return dataclasses.replace(scratch, num_barriers=(programs * math.prod(scratch.num_barriers),))
    if isinstance(scratch, plgpu.RefUnion):
        if programs != 1:
            check_program_union(scratch)
        return plgpu.RefUnion(*with_program_axis(list(scratch.refs), programs))
    rows = scratch.shape[0] if programs == 1 else padded_rows(scratch)
    return plgpu.SMEM((programs, rows, *scratch.shape[1:]), scratch.dtype, transforms=scratch.transforms)


def check_program_union(union) -> None:
    """Raise ValueError unless `union`'s members are single buffers of equal bytes per
    program (after `padded_rows`), the unions `with_program_axis` can split between programs."""
    members = list(union.refs)
    if any(isinstance(m, (list, tuple, plgpu.RefUnion)) for m in members):
        raise ValueError("a plgpu.RefUnion split between programs takes single buffers, not groups: stack a "
                         "group into one buffer")
    sizes = {padded_rows(m) * math.prod(m.shape[1:]) * jnp.dtype(m.dtype).itemsize for m in members}
    if len(sizes) > 1:
        raise ValueError(f"a plgpu.RefUnion split between programs needs members of equal bytes, got {sorted(sizes)}")


def padded_rows(buffer) -> int:
    """The first-axis extent that makes one program's slice of `buffer` (`plgpu.SMEM`) a
    whole number of `TMA_ALIGN` bytes, so that every program's slice starts as aligned as
    the first (a `[L]` fp32 ring of decays is 64 bytes: a second program's would start
    misaligned). A swizzled buffer must already be a whole number of 1 KiB."""
    row_bytes = math.prod(buffer.shape[1:]) * jnp.dtype(buffer.dtype).itemsize
    if buffer.transforms:
        if (buffer.shape[0] * row_bytes) % SWIZZLED_ALIGN:
            raise ValueError(f"a swizzled buffer {buffer.shape} is not a whole number of {SWIZZLED_ALIGN} bytes")
        return buffer.shape[0]
    step = TMA_ALIGN // math.gcd(row_bytes, TMA_ALIGN)
    return -(-buffer.shape[0] // step) * step


def program_view(refs, scratch, index, programs: int = 1):
    """The refs of `with_program_axis(scratch, programs)` at `index` of their leading axis,
    shaped as `scratch`'s (a union as the tuple of its members' views; barriers as they are
    with one program)."""
    if isinstance(scratch, (list, tuple)):
        return [program_view(ref, item, index, programs) for ref, item in zip(refs, scratch)]
    if isinstance(scratch, plgpu.Barrier):
        if programs == 1:
            return refs
        if scratch.num_barriers:
            return BarrierRange(refs, index * scratch.num_barriers[0])
        return refs.at[index]
    if isinstance(scratch, plgpu.RefUnion):
        return tuple(program_view(member, item, index, programs) for member, item in zip(tuple(refs), scratch.refs))
    if programs > 1 and padded_rows(scratch) != scratch.shape[0]:
        return refs.at[index, pl.ds(0, scratch.shape[0])]
    return refs.at[index]


@dataclasses.dataclass(frozen=True)
class BarrierRange:
    """One program's barriers of a barrier array that `with_program_axis` laid end to end:
    `.at[i]` is barrier `start + i` (one index, not a view of a view, which Mosaic GPU's
    interpret mode does not compose)."""
    ref: Any
    start: Any

    @property
    def at(self) -> BarrierRange:
        return self

    def __getitem__(self, i):
        return self.ref.at[self.start + i]


def kernel_scratch(program_scratch, *, per_tile: bool, warpgroups: int):
    """`(scratch, view)`: a kernel's scratch and what `tile_buffers` views it by: one
    program's scratch `program_scratch` stacked by `with_program_axis` and itself as the
    view where buffers are indexed by program or tile (`per_tile`, or `warpgroups` > 1),
    else as it is and None."""
    if not per_tile and warpgroups == 1:
        return program_scratch, None
    return with_program_axis(program_scratch, warpgroups), program_scratch


def opaque_zero(row, batch: int):
    """0 for every row `0 <= row < batch`, computed from the tile's row so that the
    compiler cannot prove it (nor hoist what is indexed by it out of the persistent loop)."""
    return row // batch


def tile_buffers(refs: list, program_scratch, row, batch: int, *, per_tile: bool = True, warpgroups: int = 1) -> list:
    """A kernel's shared buffers `refs` for a tile of `row`: as they are, or, given
    `program_scratch` (one program's scratch, which `with_program_axis(.., warpgroups)`
    stacked into the kernel's; `refs` its leading entries), their `program_view` at this
    program's slot (`program_slot`), plus the row's `opaque_zero` where `per_tile`."""
    if program_scratch is None:
        return refs
    index = program_slot(warpgroups)
    if per_tile:
        index = index + opaque_zero(row, batch)
    return program_view(refs, program_scratch[:len(refs)], index, warpgroups)


def serve_tiles(batch: int, heads: int, tiles: int, num_programs: int, issue: Callable, compute: Callable, *,
                group_size: int = 1, chunk: int = 0, issue_group: Callable | None = None, warpgroups: int = 1,
                row_order=None) -> None:
    """Serve tile t of head h of row b for every `(b, h, t)`: `issue(b, h, t, stage)`
    starts its copies into a stage of shared buffers, `compute(b, h, t, stage, fresh)`
    waits for them and works; `fresh` (a static True for one CTA per tile, else a traced
    bool) says whether the CTA's previous tile was of another row or head group
    (`h // group_size`; `heads` a multiple of `group_size`). One CTA per tile
    (`num_programs = 0`), or `persistent_tiles` over the tiles numbered with b slowest in
    chunks of `chunk` tiles (0: one group's tiles, at most `MAX_CHUNK`); the kernel's grid
    is `tile_grid`'s (`warpgroups` programs per CTA). With `issue_group(b, h, t)` (the group
    copies above), `compute` takes a sixth argument, `prefetch()`, to call once the group's
    buffer is no longer read.

    `row_order` (a `[B]` int32 ref, a permutation of the rows): serve the rows in that order,
    `row_order[0]` first. Listing the costliest rows first (the plan's launch order:
    flushing rows, then appending rows by descending cursor) deals their tiles first, so
    each persistent program gets a near-equal share of them and starts with them, and a
    grid of one CTA per tile launches them first. Rows keep their tiles and groups, so
    `fresh` is unchanged."""
    per_row = heads * tiles
    where = lambda index: tile_location(index, heads, tiles, row_order)
    if num_programs:
        group_tiles = group_size * tiles
        persistent_tiles(batch * per_row, num_programs, lambda index, stage: issue(*where(index), stage),
                         lambda index, stage, *rest: compute(*where(index), stage, *rest),
                         chunk=chunk or min(MAX_CHUNK, group_tiles), group_tiles=group_tiles,
                         issue_group=None if issue_group is None else lambda index: issue_group(*where(index)),
                         warpgroups=warpgroups)
        return
    b, ht = lax.axis_index("b"), lax.axis_index("ht")
    b = b if row_order is None else row_order[b]
    with jax.named_scope("issue"):
        issue(b, ht // tiles, ht % tiles, 0)
    with jax.named_scope("tile"):
        if issue_group is None:
            compute(b, ht // tiles, ht % tiles, 0, True)
        else:
            issue_group(b, ht // tiles, ht % tiles)
            compute(b, ht // tiles, ht % tiles, 0, True, lambda: None)
    plgpu.wait_smem_to_gmem(0)


def tile_location(index, heads: int, tiles: int, row_order=None) -> tuple:
    """`(row, head, tile)` of tile `index` in `serve_tiles`' flat list: rows slowest, in
    their order or in `row_order` (`row_order[r]` the r-th row served), then heads, then
    the head's tiles."""
    per_row = heads * tiles
    row = index // per_row
    return (row if row_order is None else row_order[row]), index % per_row // tiles, index % tiles


def launch_order_input(params, row_order, batch: int, kernel: str) -> list:
    """A kernel's `serve_tiles` row order as its launch input: `[row_order]` checked
    (`common.check_row_order`) where `params.launch_order`, else `[]`; ValueError where one
    is given without the other."""
    if params.launch_order != (row_order is not None):
        raise ValueError(f"{kernel}: row_order is given iff params.launch_order, got launch_order="
                         f"{params.launch_order} and row_order {'given' if row_order is not None else 'None'}")
    return [] if row_order is None else [check_row_order(row_order, batch)]


def group_shared(fresh, compute: Callable, store: Callable, load: Callable):
    """The values a head group's tiles share (`serve_tiles`'s groups): with one CTA per tile
    (`fresh` a static True) `compute()` itself; else `store(compute())` on fresh tiles,
    then a warpgroup barrier, then `load()` on every tile."""
    if fresh is True:
        return compute()

    @pl.when(fresh)
    def _share():
        store(compute())
        plgpu.commit_smem()  # the group's values visible to every thread of the warpgroup

    return load()


def chunk_size(num_tiles: int, num_programs: int, chunk: int) -> int:
    """`chunk`, or fewer tiles per chunk where that many would leave programs idle."""
    return max(1, min(chunk, num_tiles // num_programs))


def program_tiles(program, num_tiles: int, num_programs: int, chunk: int):
    """`(tile_of, count)`: program p of P serves its n-th tile `tile_of(n)`, n < count, the
    chunks `p, p + P, ...` of `chunk_size` tiles each (the last chunk of the N tiles may
    be short; count >= 1 when P <= N)."""
    chunk = chunk_size(num_tiles, num_programs, chunk)
    num_chunks = -(-num_tiles // chunk)
    mine = (num_chunks - program + num_programs - 1) // num_programs  # >= 1: P <= num_chunks
    last = program + (mine - 1) * num_programs
    count = (mine - 1) * chunk + lax.min(chunk, num_tiles - last * chunk)
    return (lambda n: (program + n // chunk * num_programs) * chunk + n % chunk), count


def persistent_tiles(num_tiles: int, num_programs: int, issue: Callable, compute: Callable, *, chunk: int,
                     group_tiles: int, issue_group: Callable | None = None, warpgroups: int = 1) -> None:
    """Run `issue(tile, stage)` (start tile's copies into `stage`) one tile ahead of
    `compute(tile, stage, fresh)` (wait for them, work, start its stores) over this CTA's
    tiles (`program_tiles` in chunks of `chunk`); `fresh`: the CTA's first tile, or one
    whose group of `group_tiles` consecutive tiles differs from the previous tile's.

    Before a stage is refilled, every thread has finished the tile it held (a warpgroup
    barrier) and every store but the newest has finished reading shared memory, so
    `compute` must issue a tile's stores from the stage's tile buffer before its small
    output store (the one left in flight, from a buffer the refill does not touch).

    `issue_group(tile)`: the group copies of fresh tiles, the first one here and each next
    one from `compute(tile, stage, fresh, prefetch)` calling `prefetch()`."""
    tile_of, count = program_tiles(program_index(warpgroups), num_tiles, num_programs, chunk)  # count >= 1
    group_of = lambda n: tile_of(n) // group_tiles
    issue(tile_of(0), 0)
    if issue_group is not None:
        issue_group(tile_of(0))

    def stage_pair(i, carry):
        for stage in range(STAGES):
            n = STAGES * i + stage

            @pl.when(n < count)
            def _serve():
                with jax.named_scope("drain"):
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    plgpu.commit_smem()  # also a warpgroup barrier: tile n - 1 is done with its stage

                @pl.when(n + 1 < count)
                def _prefetch():
                    with jax.named_scope("issue"):
                        issue(tile_of(n + 1), (stage + 1) % STAGES)

                fresh = (n == 0) | (group_of(n) != group_of(n - 1))
                if issue_group is None:
                    with jax.named_scope("tile"):
                        compute(tile_of(n), stage, fresh)
                    return

                def prefetch():
                    @pl.when((n + 1 < count) & (group_of(n + 1) != group_of(n)))
                    def _next_group():
                        issue_group(tile_of(n + 1))

                with jax.named_scope("tile"):
                    compute(tile_of(n), stage, fresh, prefetch)

        return carry

    lax.fori_loop(0, (count + STAGES - 1) // STAGES, stage_pair, None)
    plgpu.wait_smem_to_gmem(0)
