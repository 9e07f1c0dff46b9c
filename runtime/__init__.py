"""How a model runs: loading, tokenizer, backends, KV cache, engine, sampling, CLI."""
try:
    from importlib.metadata import version as _v
    __version__ = _v("llamba")
except Exception:   # running from a source tree that was never installed
    __version__ = "0.1.0"
