"""GPU tests: marked `gpu`, skipped (with the reason) where CuPy finds no usable GPU."""
from __future__ import annotations

import pytest

from gpu_env import NO_GPU


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason=f"no GPU: {NO_GPU}")
    for item in items:
        if NO_GPU and item.get_closest_marker("gpu"):
            item.add_marker(skip)
