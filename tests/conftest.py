"""Shared fixtures: real model files (fetched once into the user cache, reused after)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


def _has_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CuPy")
    for item in items:
        if item.get_closest_marker("gpu"):   # not `in item.keywords`: that holds the folder name tests/gpu too
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_path():
    """model_path('smollm2-135m') -> Path of the real GGUF, downloading it on first use."""
    from runtime.download import fetch

    def get(name: str):
        return fetch(name)
    return get
