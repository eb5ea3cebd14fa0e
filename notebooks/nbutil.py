"""Small helpers shared by the notebooks: size parameters, device labels, figure saving.

Kept beside the notebooks (not in the package) because they only serve the notebooks.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import jax


def env_int(name: str, default: int) -> int:
    """An integer parameter, overridable through the environment variable `name`."""
    return int(os.environ.get(name, default))


def env_ints(name: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """A comma-separated list of integers, e.g. `RS_CACHE_LENS=1,4,16`."""
    raw = os.environ.get(name)
    return default if not raw else tuple(int(x) for x in raw.split(","))


def repo_root(start: Path | None = None) -> Path:
    """The repository root: the first folder above `start` (default: cwd) with pyproject.toml."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file():
            return folder
    raise FileNotFoundError(f"no pyproject.toml above {here}")


def figures_dir() -> Path:
    """Where figures go: `$RS_FIG_DIR`, else notebooks/figures/ of the repository."""
    folder = Path(os.environ.get("RS_FIG_DIR") or repo_root() / "notebooks" / "figures")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def cpu_name() -> str:
    """The CPU model name (from /proc/cpuinfo on Linux, else platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_label() -> str:
    """The device jax computes on, for figure titles, e.g. 'CPU: Intel(R) Xeon(R) ...'."""
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return f"CPU: {cpu_name()}"
    return f"{dev.platform.upper()}: {dev.device_kind}"


def save_figure(fig, name: str, dpi: int = 100) -> Path:
    """Save `fig` as `<figures_dir>/<name>.png` and return the path."""
    path = figures_dir() / f"{name}.png"
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    print(f"saved {path}")
    return path
