"""Shared fixtures: a per-test random seed and the decode backend under test."""

from __future__ import annotations

import os
import zlib

# The tests compile many small programs and run each a few times: XLA's optimisation
# passes cost more than they save (about a fifth of the suite's time on two cores).
# Through the environment too, so that the tests' subprocesses (8 fake devices, the
# notebooks, the demo) compile the same way.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_disable_most_optimizations", os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1")

BACKENDS = ("xla", "pallas_triton")
RUN_SLOW = os.environ.get("REPLAYSSM_SLOW", "0") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the `heavy` tests first; skip the `slow` ones unless REPLAYSSM_SLOW=1: the suite
    must fit CI's 20 minutes on two cores, so the long variants whose branches a faster test
    also reaches (lowerings of non-default kernel options, second shapes of one path) run on
    request."""
    # The `heavy` tests (one process or notebook of tens of seconds each) go to the workers
    # first, so that none of them starts last while the other worker sits idle.
    items.sort(key=lambda item: "heavy" not in item.keywords)
    if RUN_SLOW:
        return
    skip = pytest.mark.skip(reason="slow: set REPLAYSSM_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A seed that differs per test (derived from the node id), printed for reproduction.

    Set REPLAYSSM_TEST_SEED to shift every test's seed (e.g. in a soak run); the printed
    value shows up under "Captured stdout setup" when a test fails.
    """
    base = int(os.environ.get("REPLAYSSM_TEST_SEED", "0"))
    value = (zlib.crc32(request.node.nodeid.encode()) + base) % 2**32
    print(f"seed={value} (REPLAYSSM_TEST_SEED={base}, node {request.node.nodeid})")
    return value


@pytest.fixture
def rng(seed: int) -> np.random.Generator:
    """Fresh random numbers for one test."""
    return np.random.default_rng(seed)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The `decode_step` backend (the Pallas kernels run in interpret mode off GPU)."""
    return request.param
