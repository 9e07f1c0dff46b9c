"""Numba's kernel cache lives in a folder named by the kernel sources, so a kernel that inlines a
helper from another module never keeps the helper's old machine code (quant/kernel_cache.py)."""
import os
import subprocess
import sys
import time
from pathlib import Path

from quant import kernel_cache

ROOT = Path(__file__).resolve().parents[2]


def test_an_edit_to_any_kernel_source_names_a_new_folder(tmp_path, monkeypatch):
    for sub in ("quant", "runtime/backend", "runtime/bench"):
        (tmp_path / sub).mkdir(parents=True)
    (tmp_path / "quant" / "simd.py").write_text("x = 1\n")
    (tmp_path / "runtime" / "backend" / "moe.py").write_text("y = 1\n")
    (tmp_path / "runtime" / "server.py").write_text("z = 1\n")          # no kernels: not hashed
    monkeypatch.setattr(kernel_cache, "HOME", tmp_path)
    first = kernel_cache.sources_hash()
    (tmp_path / "runtime" / "server.py").write_text("z = 2\n")
    assert kernel_cache.sources_hash() == first
    (tmp_path / "quant" / "simd.py").write_text("x = 2\n")             # a helper other kernels inline
    second = kernel_cache.sources_hash()
    assert second != first
    (tmp_path / "runtime" / "backend" / "moe.py").write_text("y = 2\n")
    assert kernel_cache.sources_hash() not in (first, second)


def test_a_fresh_process_caches_under_the_sources_hash_and_prunes_stale_folders(tmp_path):
    kernels = tmp_path / "cache" / "llamba" / "kernels"
    stale, recent = kernels / "stale", kernels / "recent"
    for d in (stale, recent):
        d.mkdir(parents=True)
    week = kernel_cache.STALE_DAYS * 86400
    os.utime(stale, (time.time() - week - 60,) * 2)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    code = ("import runtime.constrain, numba.core.config as c, os, quant.kernel_cache as k;"
            "print(c.CACHE_DIR); print(os.environ['NUMBA_CACHE_DIR']); print(k.sources_hash())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    numba_dir, env_dir, digest = out.stdout.split()
    assert numba_dir == env_dir == str(kernels / digest)
    assert not stale.exists() and recent.exists()


def test_numba_cache_dir_named_by_the_user_is_kept(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "mine"))
    code = "import quant, numba.core.config as c; print(c.CACHE_DIR)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "mine")
