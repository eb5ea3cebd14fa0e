"""Where every Mosaic GPU kernel of this package is built (`plgpu.kernel`), so the options
all of them take are set once: Mosaic's automatic barriers, interpret mode and the
on-device profiler; and the checks of the parameters the decode kernels' params classes
share (`check_shared_params`).

The profiler (off unless `PROFILE_DIR_ENV` names a folder; `benchmarks/mosaic_profile.py`
sets it) records the kernels' named regions (`jax.named_scope` blocks in the kernel bodies:
a region's enter and exit as SM clock reads, per warpgroup, into shared memory) and writes
one Chrome-trace JSON per launch into that folder. Without it the named regions lower to
nothing. The variables are read when a kernel is first built in a process (builds are
cached per shape and parameters), so set them before the first step.
"""

from __future__ import annotations

import os

from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import is_int
from pallas_kernels.mosaic_gpu.readout import READOUTS
from pallas_kernels.mosaic_gpu.rebuild import check_rebuild_mode

PROFILE_DIR_ENV = "REPLAYSSM_MOSAIC_PROFILE_DIR"
# Regions recorded per warpgroup at most (16 bytes of shared memory each); later ones
# are dropped, not written past the buffer.
PROFILE_SPACE_ENV = "REPLAYSSM_MOSAIC_PROFILE_SPACE"
DEFAULT_PROFILE_SPACE = 256


def profile_settings() -> tuple[str, int]:
    """`(folder, regions per warpgroup)` from the environment; `("", 0)`: profiler off."""
    folder = os.environ.get(PROFILE_DIR_ENV, "")
    if not folder:
        return "", 0
    space = int(os.environ.get(PROFILE_SPACE_ENV, DEFAULT_PROFILE_SPACE))
    if space < 1:
        raise ValueError(f"{PROFILE_SPACE_ENV} must be a positive count of regions, got {space}")
    return folder, space


def compiler_params(auto_barriers: bool = True) -> plgpu.CompilerParams:
    """The kernels' compiler parameters: `auto_barriers` False builds without Mosaic's
    automatic barriers (`unsafe_no_auto_barriers`: the kernel places its own); the profiler
    as the environment says (module doc)."""
    folder, space = profile_settings()
    return plgpu.CompilerParams(unsafe_no_auto_barriers=not auto_barriers, profile_space=space, profile_dir=folder,
                                profile_bounds_check=bool(space))


def build_kernel(body, out_type, scratch_types, grid: dict, *, name: str, interpret: bool,
                 auto_barriers: bool = True):
    """`plgpu.kernel` of `body` with `grid` (`grid` and `grid_names`, or `pipeline.tile_grid`'s
    arguments), named `name`, in Mosaic GPU interpret mode if `interpret`."""
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch_types,
        **grid,
        compiler_params=compiler_params(auto_barriers),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=name,
    )


WINDOW_SIDES = ("xla", "kernel")  # where a verify kernel's window scalars are formed


def check_shared_params(params) -> None:
    """Raise ValueError on a bad value of the fields `MosaicReplayParams` and
    `MosaicMamba2Params` share: `swizzle`, `rebuild`, `programs`, `chunk`, `readout`,
    `group_records`, `launch_order`, `window_side`."""
    if params.swizzle not in (32, 64, 128):
        raise ValueError(f"swizzle must be 32, 64 or 128 bytes, got {params.swizzle!r}")
    check_rebuild_mode(params.rebuild)
    for name in ("programs", "chunk"):
        value = getattr(params, name)
        if not is_int(value) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if params.readout not in READOUTS:
        raise ValueError(f"readout must be one of {READOUTS}, got {params.readout!r}")
    if params.group_records is not None and not isinstance(params.group_records, bool):
        raise ValueError(f"group_records must be None, True or False, got {params.group_records!r}")
    if not isinstance(params.launch_order, bool):
        raise ValueError(f"launch_order must be a bool, got {params.launch_order!r}")
    if params.window_side not in WINDOW_SIDES:
        raise ValueError(f"window_side must be one of {WINDOW_SIDES}, got {params.window_side!r}")


def check_no_window(params, kernel: str) -> None:
    """Raise ValueError unless `params` leaves the window to XLA (`window_side` "xla") and
    prefetches no folds: a decode kernel has no verify window."""
    if params.window_side != "xla":
        raise ValueError(f"{kernel} has no verify window: window_side must be 'xla', got {params.window_side!r}")
    for name in ("prefetch_folds", "group_folds"):
        if getattr(params, name, False):
            raise ValueError(f"{kernel} has no verify folds: {name} must be False")
