"""The model a server holds: loaded in a thread while the server already answers /health
(503 until it is ready), then driven by one Scheduler in its own thread.  `ModelHost.from_engine`
serves an engine that is loaded already (the desktop app's local server): the scheduler's
thread drives it until `shutdown`, which hands it back."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class ServeConfig:
    model: str | None = None
    device: str = "cpu"
    threads: int | None = None
    n_ctx: int = 4096                 # a request's context: prompt + answer
    parallel: int = 8                 # requests computed at once
    queue: int = 64                   # requests waiting beyond those
    kv_tokens: int = 0                # KV-cache pool in tokens (0: parallel x n_ctx, within kv_budget)
    kv_budget: int = 2 << 30          # bytes the default pool may take
    cache_type: str = "f16"
    chunk: int = 512
    prefix_cache: bool = True
    gpu_layers: int | None = None
    cpu_moe: int = 0                  # --cpu-moe (-1) / --n-cpu-moe N: experts in system memory, on the CPU
    draft_model: str | None = None
    # MiB of KV blocks that finished requests may keep cached for prefix reuse (None: on the CPU
    # CACHE_RAM_MIB, llama-server's default; -1: the whole pool).  The CPU's pools are mapped
    # lazily: the server's memory grows with each distinct prompt up to the bound, then stays.
    cache_ram: int | None = None
    reasoning_format: str = "auto"    # "none": a model's reasoning stays in content (answer.py)


# llama-server's --cache-ram default.  An eighth of the pool (sessions 30-31) kept the resident
# memory small but let a repeated prompt set of 8 clients (~5,000 tokens) fall out of the cache,
# so warm requests recomputed prompts llama-server answered from its slots (its whole pool is
# resident from the start): this bound spends no more memory than the peer does.
CACHE_RAM_MIB = 8192


class ModelHost:
    def __init__(self, cfg: ServeConfig, announce=print):
        self.cfg = cfg
        self.announce = announce
        self.engine = None
        self.scheduler = None
        self.model_id = ""
        self.error: str | None = None
        self.ready = threading.Event()
        self.started = time.time()

    def load(self) -> None:
        """Load the model and start the scheduler (call in a thread)."""
        try:
            self._load()
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            self.announce(f"error: could not load the model: {self.error}")
        finally:
            self.ready.set()

    def _load(self) -> None:
        from ..engine import Engine
        from ..loader import load_model
        from ..warmup import warm_up
        from ..backend.cpu import kv_bytes_per_token_layer
        cfg = self.cfg
        lm = load_model(cfg.model)
        c = lm.config
        n_ctx = min(cfg.n_ctx or 4096, c.context_length)
        per_token = c.n_layers * kv_bytes_per_token_layer(c.n_kv_heads, c.head_dim, cfg.cache_type)
        tokens = cfg.kv_tokens or max(2 * n_ctx, min(cfg.parallel * n_ctx, cfg.kv_budget // max(1, per_token)))
        block = 16
        blocks = -(-max(tokens, n_ctx + block) // block)
        eng = Engine(lm, device=cfg.device, n_ctx=n_ctx, threads=cfg.threads, cache_blocks=blocks,
                     cache_type=cfg.cache_type, gpu_layers=cfg.gpu_layers, cpu_moe=cfg.cpu_moe,
                     announce=self.announce)
        warm_up(eng, notice=self.announce)
        keep = cached_blocks(cfg, eng)
        eng.cache.limit_cached(keep)
        self.model_id = lm.path.stem if lm.path.is_file() else lm.path.name
        kept = "" if keep is None else f", at most {keep * block * per_token / 2**20:.0f} MiB of it kept for prefix reuse"
        self.announce(f"model {self.model_id}: context {n_ctx} tokens a request, KV pool {blocks * block} tokens "
                      f"({blocks * block * per_token / 2**20:.0f} MiB{kept}), {cfg.parallel} requests at once")
        drafter = None
        if cfg.draft_model:
            from ..speculative import Drafter
            drafter = Drafter.load(cfg.draft_model, eng, announce=self.announce)
            warm_up(drafter.draft, notice=self.announce)
        self.attach(eng, drafter=drafter)

    def attach(self, engine, on_step=None, drafter=None) -> None:
        """Serve `engine` (loaded and warm): a Scheduler started on it drives it from now on."""
        from ..scheduler import Scheduler
        cfg = self.cfg
        self.engine = engine
        if not self.model_id:
            path = engine.loaded.path
            self.model_id = path.stem if path.is_file() else path.name
        self.scheduler = Scheduler(engine, max_running=cfg.parallel, max_waiting=cfg.queue, chunk=cfg.chunk,
                                   prefix_cache=cfg.prefix_cache, on_step=on_step, drafter=drafter).start()

    @classmethod
    def from_engine(cls, engine, cfg: ServeConfig | None = None, model_id: str = "", on_step=None,
                    announce=print) -> "ModelHost":
        """A host, ready, around an engine loaded elsewhere; `on_step(scheduler)` runs in the
        engine thread after each scheduler iteration."""
        mh = cls(cfg or ServeConfig(n_ctx=engine.n_ctx), announce=announce)
        mh.model_id = model_id
        mh.attach(engine, on_step=on_step)
        mh.ready.set()
        return mh

    def shutdown(self) -> None:
        """Stop the scheduler: what was in flight ends "cancelled" and its blocks go back; once
        this returns no thread of the host touches the engine."""
        if self.scheduler is not None:
            self.scheduler.shutdown()


def cached_blocks(cfg: ServeConfig, engine) -> int | None:
    """The cached-block bound of cfg.cache_ram for this engine's pool (None: no bound)."""
    bpb = engine.cache.bytes_per_token * engine.block_size
    if cfg.cache_ram is not None:
        return None if cfg.cache_ram < 0 else (cfg.cache_ram << 20) // max(1, bpb)
    if engine.backend.name != "cpu":        # device memory is allocated whole: nothing to save
        return None
    bound = (CACHE_RAM_MIB << 20) // max(1, bpb)
    return None if bound >= engine.cache.num_blocks else bound

