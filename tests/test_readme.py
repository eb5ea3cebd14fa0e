"""The README's usage example runs as written and does what its comments say."""

from __future__ import annotations

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_example_runs():
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    y, state, live = scope["y"], scope["state"], scope["live"]
    assert y.shape == (3, 4, 64) and live.shape == (3, 4, 64, 64)
    assert np.all(np.asarray(y)[2] == 0), "row 2 is a padding row"
    # 40 tokens with L = 16: flushes after tokens 16 and 32, then 8 cached entries.
    np.testing.assert_array_equal(np.asarray(state.write_pos)[[5, 2]], [8, 8])
