# PyInstaller runtime hook: runs before any of our code in the frozen app.
# Numba compiles kernels on the user's machine, for the user's CPU (never the
# build machine's), and caches them in the user's cache dir: the install folder
# is read-only, and a cache built elsewhere could hold instructions this CPU lacks.
import os
import sys

if getattr(sys, "frozen", False) and "NUMBA_CACHE_DIR" not in os.environ:
    import platformdirs
    os.environ["NUMBA_CACHE_DIR"] = os.path.join(platformdirs.user_cache_dir("llamba"), "numba")
