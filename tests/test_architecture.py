"""Imports run one way: `replayssm_jax` uses `pallas_kernels`, never the reverse."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_kernel_module_imports_the_package():
    files = sorted((ROOT / "pallas_kernels").rglob("*.py"))
    assert files, "no kernel modules found"
    offenders = {str(f.relative_to(ROOT)): sorted(m for m in _imported_modules(f) if m.split(".")[0] == "replayssm_jax")
                 for f in files}
    assert not any(offenders.values()), {f: m for f, m in offenders.items() if m}


def test_importing_the_kernels_alone_does_not_load_the_package():
    script = (
        "import sys, pkgutil, importlib, pallas_kernels\n"
        "for m in pkgutil.iter_modules(pallas_kernels.__path__):\n"
        "    importlib.import_module('pallas_kernels.' + m.name)\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] == 'replayssm_jax'))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=ROOT, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_the_scanner_sees_package_imports():
    # The first test must be able to fail: the scanner finds this package's own imports.
    assert "replayssm_jax.plan" in _imported_modules(ROOT / "replayssm_jax" / "decode.py")
