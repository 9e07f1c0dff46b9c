"""How a model runs: loading, tokenizer, backends, KV cache, engine, sampling, CLI."""
from ._home import claim as _claim

_claim()     # `models`, `quant`, `app` are ours even where the working folder has a models/


def _version() -> str:
    """One version number, pyproject's: from the installed metadata, else the source tree."""
    try:
        from importlib.metadata import version
        return version("llamba")
    except Exception:
        import tomllib
        from pathlib import Path
        try:
            with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as f:
                return tomllib.load(f)["project"]["version"]
        except OSError:
            return "unknown"


__version__ = _version()
