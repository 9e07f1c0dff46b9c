"""The engine's thread.  It loads models and runs chat turns through
`runtime.chat.ChatSession`, and reports through Qt signals; it never touches a
widget.  The UI asks for work with signals (queued into this thread) and stops a
running answer through a threading.Event, which the token loop checks after
every decoded token — a queued signal could not get in while the loop runs.
"""
from __future__ import annotations

import inspect
import threading
import time
import traceback

from PySide6.QtCore import QObject, Signal, Slot

_ENGINES: dict = {}      # the one loaded engine, kept across windows (reopening a window is instant)


def friendly_error(e: BaseException, device: str = "") -> str:
    """One clear sentence for the window, not a traceback."""
    name = type(e).__name__
    if isinstance(e, MemoryError) or "OutOfMemory" in name:
        where = "the GPU" if device in ("cuda", "gpu") or "OutOfMemory" in name else "this computer"
        return (f"Out of memory on {where}. Try fewer GPU layers, a shorter context length or a "
                f"smaller model. ({name})")
    if isinstance(e, FileNotFoundError):
        return str(e)
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    return f"{e} ({name})" if str(e) else name


class EngineWorker(QObject):
    status = Signal(str)                      # a line for the status bar
    download_progress = Signal(object, object, str)  # done bytes, total bytes, label
    loaded = Signal(object)                   # model info (dict)
    load_failed = Signal(str)
    piece = Signal(int, str)                  # request id, text
    stats = Signal(int, object)               # request id, live numbers (see _live_stats)
    finished = Signal(int, object)            # request id, final numbers with stop_reason
    failed = Signal(int, str)                 # request id, message

    def __init__(self):
        super().__init__()
        self.engine = None
        self.session = None
        self.info: dict = {}
        self._stop = threading.Event()

    # ---- called from the UI thread --------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()

    # ---- loading ---------------------------------------------------------------
    @Slot(object)
    def load(self, cfg: dict) -> None:
        try:
            self._load(cfg)
        except BaseException as e:           # a bad model must never take the window down
            traceback.print_exc()
            self.engine = self.session = None
            self.load_failed.emit(friendly_error(e, cfg.get("device", "")))

    def _load(self, cfg: dict) -> None:
        from runtime.chat import ChatSession
        from runtime.engine import Engine
        from runtime.loader import resolve_model_path

        key = (cfg["model"], cfg.get("device", "cpu"), cfg.get("gpu_layers", -1), cfg.get("n_ctx", 0))
        engine = _ENGINES.get(key)
        t0 = time.perf_counter()
        if engine is None:
            _ENGINES.clear()          # let the previous model's memory go before loading the next
            self.engine = self.session = None
            self.status.emit(f"Looking for {cfg['model']}…")
            path = resolve_model_path(cfg["model"], progress=self.download_progress.emit)
            self.status.emit(f"Loading {path.name}…")
            kwargs = dict(device=cfg.get("device", "cpu"), n_ctx=cfg.get("n_ctx", 0), announce=self.status.emit)
            if "gpu_layers" in inspect.signature(Engine).parameters:
                kwargs["gpu_layers"] = cfg.get("gpu_layers", -1)
            engine = Engine(str(path), **kwargs)
            # Numba compiles the kernels on their first call and caches them on disk:
            # a tiny throwaway forward pays that cost here, not in the first answer.
            self.status.emit("Compiling kernels (first run only)…")
            tw = time.perf_counter()
            seq = engine.new_sequence()
            ids = engine.tokenizer.encode("Hello")
            engine.prefill(seq, ids)
            engine.step([seq], [[ids[-1]]])
            engine.release(seq)
            warm = time.perf_counter() - tw
            _ENGINES[key] = engine
        else:
            warm = 0.0
        self.engine = engine
        self.session = ChatSession(engine)
        cfg_m = engine.config
        lm = engine.loaded
        self.info = {
            "model": cfg["model"], "path": str(lm.path), "name": cfg_m.name or lm.path.stem,
            "arch": cfg_m.arch, "n_params": lm.n_params, "weight_bytes": lm.weight_bytes,
            "device": getattr(engine.backend, "device_name", getattr(engine.backend, "name", "?")),
            "n_ctx": engine.n_ctx, "load_seconds": time.perf_counter() - t0, "warmup_seconds": warm,
            "has_template": bool(lm.chat_template), "draft": cfg.get("draft_model", ""),
            "kv": engine.stats(),
        }
        self.status.emit(f"Ready: {lm.path.name} on {self.info['device']}")
        self.loaded.emit(self.info)

    # ---- answering -------------------------------------------------------------
    @Slot(object)
    def generate(self, req: dict) -> None:
        """req: id, kind (send | regenerate | edit), system, history (turns before the
        answer, the last one the user's), params, max_tokens, overflow."""
        rid = req["id"]
        if self.session is None:
            self.failed.emit(rid, "No model is loaded.")
            return
        self._stop.clear()
        try:
            final = self._answer(req)
        except BaseException as e:
            traceback.print_exc()
            # the cached sequence may be half-written: start the next turn from a clean one
            try:
                self.session.clear()
            except Exception:
                pass
            self.failed.emit(rid, friendly_error(e, self.info.get("device", "")))
            return
        self.finished.emit(rid, final)

    def _answer(self, req: dict) -> dict:
        from runtime.sampling import SamplingParams
        s = self.session
        rid = req["id"]
        p = req.get("params", {})
        s.params = SamplingParams(temperature=p.get("temperature", 0.7), top_k=p.get("top_k", 40),
                                  top_p=p.get("top_p", 0.95), min_p=p.get("min_p", 0.05),
                                  repeat_penalty=p.get("repeat_penalty", 1.0), seed=p.get("seed"))
        s.max_tokens = int(req.get("max_tokens", 1024))
        s.system = req.get("system") or None
        turns, dropped = self._fit(list(req["history"]), s.max_tokens, req.get("overflow", "drop-oldest"))
        if dropped:
            self.status.emit(f"Context is full: left out the {dropped} oldest message(s) of this chat.")
        kind = req.get("kind", "send")
        # Hand ChatSession the conversation as the UI shows it, then ask for the turn
        # the user asked for (so its KV reuse sees the same messages).
        if kind == "regenerate":
            s.messages = turns + [{"role": "assistant", "content": req.get("old_answer", "")}]
            stream = s.regenerate(self._stop.is_set, self._on_step)
        elif kind == "edit":
            s.messages = turns[:-1] + [{"role": "user", "content": req.get("old_text", turns[-1]["content"])}]
            stream = s.edit(len(turns) - 1, turns[-1]["content"], self._stop.is_set, self._on_step)
        else:
            s.messages = turns[:-1]
            stream = s.send(turns[-1]["content"], self._stop.is_set, self._on_step)
        self._rid, self._last_step, self._rates = rid, None, []
        first = True
        for text in stream:
            self.piece.emit(rid, text)
            if first:
                first = False
                self.stats.emit(rid, self._live_stats(s.last_generation))
        gen = s.last_generation
        out = self._live_stats(gen)
        out["stop_reason"] = gen.stats.stop_reason
        out["dropped"] = dropped
        return out

    def _fit(self, turns: list[dict], max_tokens: int, policy: str) -> tuple[list[dict], int]:
        """Make the prompt fit the context with room to answer, or say it cannot."""
        s, n_ctx = self.session, self.engine.n_ctx
        room = min(max_tokens, max(n_ctx // 4, 16))
        dropped = 0
        while True:
            s.messages = turns
            n = len(s.prompt_ids())
            if n + room <= n_ctx:
                return turns, dropped
            if policy != "drop-oldest" or len(turns) <= 1:
                raise ContextFull(n, n_ctx, room)
            turns = turns[1:]
            dropped += 1

    def _on_step(self, gen) -> None:
        now = time.perf_counter()
        if self._last_step is not None:
            dt = now - self._last_step
            if dt > 0:
                self._rates.append(1.0 / dt)
        self._last_step = now
        self.stats.emit(self._rid, self._live_stats(gen))

    def _live_stats(self, gen) -> dict:
        st = gen.stats
        eng = self.engine
        seq = gen.seq
        return {
            "prompt_tokens": st.prompt_tokens, "reused_tokens": st.reused_tokens,
            "prompt_tokens_per_s": st.prompt_tokens_per_s, "generated_tokens": st.generated_tokens,
            "tokens_per_s": st.tokens_per_s, "rate_history": list(self._rates[-200:]),
            "context_tokens": len(seq) if seq is not None else 0, "n_ctx": eng.n_ctx,
            "speculative": dict(st.speculative or {}), "kv": eng.stats(),
        }


class ContextFull(RuntimeError):
    def __init__(self, n: int, n_ctx: int, room: int):
        super().__init__(f"Context overflow: this conversation needs {n} tokens plus {room} to answer, "
                         f"but the context holds {n_ctx}. Start a new chat, raise the context length, "
                         f"or choose the “drop the oldest messages” overflow policy in Settings.")
