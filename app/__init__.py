"""The Llamba desktop chat window (`python -m app`, or the `llamba` launcher)."""
from __future__ import annotations


def _version() -> str:
    """One version number: the installed package's metadata, else pyproject.toml
    of the source tree we are running from."""
    try:
        from importlib.metadata import version
        return version("llamba")
    except Exception:
        pass
    try:
        import tomllib
        from pathlib import Path
        with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as f:
            return tomllib.load(f)["project"]["version"]
    except Exception:
        return "unknown"


__version__ = _version()
