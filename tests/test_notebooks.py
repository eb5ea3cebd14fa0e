"""Every notebook under notebooks/ runs top to bottom at its small default size.

The notebooks are kept as jupytext percent-format .py files; each is converted to a
notebook here and executed with nbclient on a python3 kernel that runs this interpreter
(`sys.executable`, so the venv's packages). A cell error fails the test. Figures go to a
temporary folder (RS_FIG_DIR) so the committed PNGs are not rewritten by CI.

Run one by hand (prints the cell outputs):  python tests/test_notebooks.py 01_quickstart
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(p.stem for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.py"))
KERNEL_NAME = "replayssm-venv-python3"
CELL_TIMEOUT_S = 300


def _install_kernelspec(folder: Path) -> None:
    """A kernelspec named KERNEL_NAME under `folder`/kernels that runs sys.executable."""
    spec_dir = folder / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (replayssm-jax test)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))


def notebook_env(fig_dir: Path, jupyter_dir: Path) -> dict[str, str]:
    """Environment for the kernel: our kernelspec on JUPYTER_PATH, figures to `fig_dir`."""
    _install_kernelspec(jupyter_dir)
    jupyter_path = [str(jupyter_dir), os.environ.get("JUPYTER_PATH", "")]
    return {
        "JUPYTER_PATH": os.pathsep.join(p for p in jupyter_path if p),
        "RS_FIG_DIR": str(fig_dir),
        "MPLBACKEND": "Agg",
        "RS_ACCURACY_STEPS": os.environ.get("RS_ACCURACY_STEPS", "256"),  # notebook 03: 10^4 steps by default
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
    }


def run_notebook(name: str):
    """Convert notebooks/<name>.py and execute it in notebooks/; return the executed notebook.

    The kernel inherits os.environ: set `notebook_env(...)` there first.
    """
    nb = jupytext.read(NOTEBOOK_DIR / f"{name}.py")
    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL_NAME,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    client.execute()
    return nb


def _text_outputs(nb) -> str:
    chunks = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            chunks.append(out.get("text") or out.get("data", {}).get("text/plain", ""))
    return "\n".join(chunks)


def test_notebooks_found():
    assert {"01_quickstart", "02_cache_length", "03_dtype_accuracy", "04_speculative"} <= set(NOTEBOOKS)


@pytest.mark.heavy
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path, monkeypatch):
    fig_dir = tmp_path / "figures"
    for var, value in notebook_env(fig_dir, tmp_path / "jupyter").items():
        monkeypatch.setenv(var, value)
    nb = run_notebook(name)
    assert nb.cells
    if name != "01_quickstart":
        assert list(fig_dir.glob("*.png")), f"{name} saved no figure"


if __name__ == "__main__":
    for nb_name in sys.argv[1:] or NOTEBOOKS:
        with tempfile.TemporaryDirectory() as tmp:
            figs = Path(os.environ.get("RS_FIG_DIR") or Path(tmp) / "figures")
            os.environ.update(notebook_env(figs, Path(tmp) / "jupyter"))
            start = time.perf_counter()
            executed = run_notebook(nb_name)
            print(_text_outputs(executed))
            print(f"== {nb_name}: {time.perf_counter() - start:.1f} s")
