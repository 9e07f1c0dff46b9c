"""The CPU backend sets numpy's BLAS threads to its own thread count (so
`-t 1` prompt processing runs its sgemm on one core)."""
import numpy as np
import pytest

from quant.blas_threads import get_blas_threads, set_blas_threads


def test_set_and_get_round_trip():
    before = get_blas_threads()
    if before is None:
        pytest.skip("numpy is not linked to OpenBLAS here")
    try:
        assert set_blas_threads(1)
        assert get_blas_threads() == 1
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        np.testing.assert_array_equal(a @ a.T, (a.astype(np.float64) @ a.T).astype(np.float32))
    finally:
        set_blas_threads(before)
    assert get_blas_threads() == before


def test_cpu_backend_uses_its_thread_count():
    if get_blas_threads() is None:
        pytest.skip("numpy is not linked to OpenBLAS here")
    import numba
    from runtime.backend.cpu import CPUBackend
    before, nthr = get_blas_threads(), numba.get_num_threads()
    try:
        CPUBackend(threads=1)
        assert get_blas_threads() == 1
    finally:
        set_blas_threads(before)
        numba.set_num_threads(nthr)
