"""The engine's thread.  It loads models and runs chat turns through
`runtime.chat.ChatSession`, and reports through Qt signals; it never touches a
widget.  The UI asks for work with signals (queued into this thread) and stops a
running answer through a threading.Event, which the token loop checks after
every decoded token — a queued signal could not get in while the loop runs.

The local server: while it is on, the engine belongs to the server's Scheduler
(runtime/scheduler.py) and is driven from its thread only.  The window's own turns
then become scheduler Requests beside the server's (their prompt rendered by the
ChatSession as before), whose events come back as the same signals; this thread
only submits them.  Turning the server off shuts the scheduler down and the engine
is this thread's again.
"""
from __future__ import annotations

import gc
import inspect
import json
import os
import secrets
import threading
import time
import traceback

from PySide6.QtCore import QObject, QThread, Signal, Slot

WORKER_NICE = 5
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
    if name == "ContextOverflow":
        return (f"Context overflow: {e}. Start a new chat, raise the context length, or choose "
                f"another overflow policy (drop the oldest turns, or shift the context) in Settings.")
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    return f"{e} ({name})" if str(e) else name


class EngineWorker(QObject):
    status = Signal(str)                      # a line for the status bar
    download_progress = Signal(float, float, str)  # done bytes, total bytes, label
    loaded = Signal(str)                      # model info (JSON)
    load_failed = Signal(str)
    piece = Signal(int, str)                  # request id, text
    stats = Signal(int, str)                  # request id, live numbers as JSON (see _live_stats)
    finished = Signal(int, str)               # request id, final numbers with stop_reason (JSON)
    failed = Signal(int, str)                 # request id, message
    server_started = Signal(str)              # JSON: url, api_key, model
    server_stopped = Signal(str)              # "" or why it could not start
    # Only ints and strings cross threads: PySide6 6.8+ has crashed on Python-object
    # payloads in queued cross-thread signals (PYSIDE-3124).

    def __init__(self):
        super().__init__()
        self.engine = None
        self.session = None
        self.info: dict = {}
        self._stop = threading.Event()
        self.chat_id = None
        self.server = None                    # runtime.server.BackgroundServer while the local server is on
        self.server_info: dict = {}
        # the scheduler's requests in flight, published from its thread after each iteration
        # (a dict replaced whole, never changed: the window reads it on a timer)
        self.server_snapshot: dict | None = None
        self._app_requests: dict = {}         # scheduler request id -> the window's request id
        self._served = 0
        self._in_flight: set = set()
        self._sreq = None                     # the window's own request on the scheduler

    @Slot()
    def lower_priority(self) -> None:
        """Run in the worker thread at start: a nicer scheduling priority for it (and
        for Numba's pool threads, which it starts and which inherit it on Linux), so
        the UI thread wins the CPU when both want it and the window never stutters."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
        except (AttributeError, OSError):
            pass            # not Linux, or not allowed: the window is merely less smooth

    @Slot()
    def shut_down(self) -> None:
        """The window is closing: give the conversation's KV blocks back (the engine
        outlives the window) and end this thread's event loop."""
        try:
            self._stop_server()
            if self.session is not None:
                self.session.clear()
        finally:
            self.session = None
            QThread.currentThread().quit()

    # ---- called from the UI thread --------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()
        r, srv = self._sreq, self.server
        if r is not None:
            r.cancel()
            if srv is not None:
                srv.host.scheduler.wake()

    # ---- loading ---------------------------------------------------------------
    @Slot(str)
    def load(self, cfg_json: str) -> None:
        cfg = json.loads(cfg_json)
        self._stop_server()                # the engine is this thread's again before it goes
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
        from runtime.warmup import warm_up

        device = cfg.get("device", "cpu")
        overflow = cfg.get("overflow", "stop")
        engine_overflow = "shift" if overflow == "shift" else "stop"
        gpu_layers = cfg.get("gpu_layers", -1)
        cpu_moe = cfg.get("cpu_moe", 0)
        key = (cfg["model"], device, gpu_layers, cpu_moe, cfg.get("n_ctx", 0), engine_overflow,
               cfg.get("draft_model", ""))
        cached = _ENGINES.get(key)
        t0 = time.perf_counter()
        warm = 0.0
        if cached is None:
            _ENGINES.clear()          # let the previous model's memory go before loading the next
            self.engine = self.session = None
            self.status.emit(f"Looking for {cfg['model']}…")
            path = resolve_model_path(cfg["model"], progress=lambda d, t, label: self.download_progress.emit(d, t, label))
            self.status.emit(f"Loading {path.name}…")
            kwargs = dict(device=device, n_ctx=cfg.get("n_ctx", 0), announce=self.status.emit)
            params = inspect.signature(Engine).parameters
            if "gpu_layers" in params and device != "cpu" and gpu_layers >= 0:
                kwargs["gpu_layers"] = gpu_layers           # -1: the whole model on the GPU
            if "cpu_moe" in params and device != "cpu" and cpu_moe:
                kwargs["cpu_moe"] = cpu_moe                 # -1: every layer's experts on the CPU
            if "overflow" in params:
                kwargs["overflow"] = engine_overflow
            engine = Engine(str(path), **kwargs)
            # Numba compiles the kernels on their first call and caches them on disk:
            # throwaway forwards at every row count pay that cost here, not in an answer.
            self.status.emit("Compiling kernels (first run only)…")
            warm = warm_up(engine, force=True)
            drafter, draft_note = self._load_draft(cfg.get("draft_model", ""), engine)
            cached = _ENGINES[key] = (engine, drafter, draft_note)
        engine, drafter, draft_note = cached
        self.engine = engine
        kwargs = {}
        session_params = inspect.signature(ChatSession).parameters
        if "overflow" in session_params:
            kwargs["overflow"] = overflow if overflow in ("stop", "drop-turns", "shift") else "stop"
        if drafter is not None and "drafter" in session_params:
            kwargs["drafter"] = drafter
        self.session = ChatSession(engine, **kwargs)
        self.chat_id = None
        cfg_m = engine.config
        lm = engine.loaded
        self.info = {
            "model": cfg["model"], "path": str(lm.path), "name": lm.path.stem or cfg_m.name,
            "arch": cfg_m.arch, "n_params": lm.n_params, "n_active_params": lm.n_active_params,
            "weight_bytes": lm.weight_bytes,
            "device": getattr(engine.backend, "device_name", getattr(engine.backend, "name", "?")),
            "n_ctx": engine.n_ctx, "load_seconds": time.perf_counter() - t0, "warmup_seconds": warm,
            "has_template": bool(lm.chat_template), "draft": draft_note, "kv": engine.stats(),
        }
        # What is alive now (the model, its kernels, the window) lives as long as the
        # session: out of the garbage collector's view, a full collection during an
        # answer no longer walks it (it had stalled the window 180 ms under a large heap)
        gc.collect()
        gc.freeze()
        self.status.emit(f"Ready: {lm.path.name} on {self.info['device']}")
        self.loaded.emit(json.dumps(self.info))

    def _load_draft(self, draft_model: str, engine):
        """(Drafter or None, a line for the panel).  A draft that cannot be used is
        reported, not fatal: the model answers without it."""
        if not draft_model:
            return None, ""
        try:
            from runtime.chat import ChatSession
            from runtime.speculative import Drafter
            if "drafter" not in inspect.signature(ChatSession).parameters:
                return None, f"{draft_model}: not used (this runtime's chat has no draft support)"
            self.status.emit(f"Loading the draft model {draft_model}…")
            d = Drafter.load(draft_model, engine, announce=self.status.emit)
            from runtime.warmup import warm_up
            warm_up(d.draft, force=True)
            return d, draft_model
        except Exception as e:
            traceback.print_exc()
            return None, f"{draft_model}: not used ({friendly_error(e)})"

    # ---- answering -------------------------------------------------------------
    @Slot(str)
    def generate(self, req_json: str) -> None:
        """req (JSON): id, kind (send | regenerate | edit), system, history (turns before the
        answer, the last one the user's), params, max_tokens, overflow."""
        req = json.loads(req_json)
        rid = req["id"]
        if self.session is None:
            self.failed.emit(rid, "No model is loaded.")
            return
        self._stop.clear()
        if self.server is not None:
            return self._submit(req)
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
        self.finished.emit(rid, json.dumps(final))

    def _prepare(self, req: dict):
        """The session set for this turn: sampling, max tokens, constraint, system prompt, chat."""
        from runtime.sampling import SamplingParams
        s = self.session
        p = req.get("params", {})
        s.params = SamplingParams(temperature=p.get("temperature", 0.7), top_k=p.get("top_k", 40),
                                  top_p=p.get("top_p", 0.95), min_p=p.get("min_p", 0.05),
                                  repeat_penalty=p.get("repeat_penalty", 1.0), seed=p.get("seed"))
        s.max_tokens = int(req.get("max_tokens", 1024))
        schema = (p.get("json_schema") or "").strip()
        if hasattr(s, "constraint"):       # answers held to a JSON schema (a ConstraintError fails the turn)
            from runtime.constrain import Constraint
            s.constraint = Constraint.json_schema(schema, s.engine) if schema else None
        s.system = req.get("system") or None
        turns = list(req["history"])
        if req.get("chat_id") != self.chat_id:
            s.clear()                 # another chat: its own prompt, its own sequence
            self.chat_id = req.get("chat_id")
        if getattr(s, "first_shown", 0) >= len(turns):
            s.first_shown = 0         # an edit went back before the turns it had dropped
        return s, turns

    def _answer(self, req: dict) -> dict:
        s, turns = self._prepare(req)
        rid = req["id"]
        dropped_before = getattr(s, "dropped_turns", 0)
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
                self.stats.emit(rid, json.dumps(self._live_stats(s.last_generation)))
        gen = s.last_generation
        out = self._live_stats(gen)
        out["stop_reason"] = gen.stats.stop_reason
        out["dropped"] = getattr(s, "dropped_turns", 0) - dropped_before
        return out

    # ---- the local server ------------------------------------------------------
    @Slot(str)
    def start_server(self, cfg_json: str) -> None:
        """cfg (JSON): port, api_key (generated when empty), parallel."""
        cfg = json.loads(cfg_json)
        if self.server is not None:
            self.server_started.emit(json.dumps(self.server_info))
            return
        if self.engine is None or self.session is None:
            self.server_stopped.emit("No model is loaded.")
            return
        from runtime.server import BackgroundServer
        from runtime.server.host import ModelHost, ServeConfig
        key = cfg.get("api_key") or "sk-llamba-" + secrets.token_urlsafe(24)
        # the conversation's blocks go back to the pool (cached: the next turn reuses its prefix)
        self.session.clear()
        self.chat_id = None
        self._app_requests.clear()
        self._served, self._in_flight = 0, set()
        self.server_snapshot = {"running": 0, "waiting": 0, "served": 0, "requests": []}
        try:
            sc = ServeConfig(n_ctx=self.engine.n_ctx, parallel=int(cfg.get("parallel", 4)),
                             queue=int(cfg.get("queue", 16)))
            host = ModelHost.from_engine(self.engine, sc, model_id=self.info.get("name", ""),
                                         on_step=self._on_scheduler_step, announce=self.status.emit)
            srv = BackgroundServer(host, "127.0.0.1", int(cfg.get("port", 8080)), api_key=key)
            url = srv.start()     # (on failure it has stopped the scheduler: the engine is ours again)
        except BaseException as e:
            traceback.print_exc()
            self.server_snapshot = None
            self.server_stopped.emit(f"The local server could not start: {friendly_error(e)}")
            return
        self.server = srv
        self.server_info = {"url": url, "api_key": key, "model": host.model_id}
        self.status.emit(f"Serving {host.model_id} at {url}")
        self.server_started.emit(json.dumps(self.server_info))

    @Slot()
    def stop_server(self) -> None:
        if self._stop_server():
            self.status.emit("The local server is off")

    def _stop_server(self) -> bool:
        srv, self.server = self.server, None
        if srv is None:
            return False
        try:
            srv.stop()            # requests in flight (the window's too) end "cancelled"
        finally:
            self._sreq = None
            self.server_snapshot = None
            self.server_info = {}
            self.chat_id = None   # the next turn renders its chat afresh on this thread
            if self.session is not None:
                self.session.clear()
            self.server_stopped.emit("")
        return True

    def _submit(self, req: dict) -> None:
        """A turn of the window's while the server is on: a Request on the server's scheduler."""
        from runtime.scheduler import QueueFull, Request
        rid = req["id"]
        try:
            s, turns = self._prepare(req)
            s.messages = list(turns)          # the conversation up to the user's last message
            dropped_before = getattr(s, "dropped_turns", 0)
            ids = s.prompt_ids()
            n_ctx = self.engine.n_ctx
            if len(ids) >= n_ctx:
                raise ValueError(f"the prompt is {len(ids)} tokens, the context is {n_ctx}: start a new chat "
                                 f"or raise the context length in Settings")
            matcher = s.constraint.matcher() if getattr(s, "constraint", None) is not None else None
            live = {"rid": rid, "rates": [], "last": None, "emitted": 0.0,
                    "dropped": getattr(s, "dropped_turns", 0) - dropped_before}
            r = Request(ids, s.params, max_tokens=max(1, min(s.max_tokens, n_ctx - len(ids))), matcher=matcher)
            r.on_event = lambda ev: self._on_app_event(r, live, ev)
        except BaseException as e:
            traceback.print_exc()
            self.failed.emit(rid, friendly_error(e, self.info.get("device", "")))
            return
        self._app_requests[r.id] = rid
        self._sreq = r
        try:
            self.server.host.scheduler.submit(r)
        except QueueFull:
            self._app_requests.pop(r.id, None)
            self._sreq = None
            self.failed.emit(rid, "The local server is busy: too many requests are waiting. Try again shortly.")

    def _on_app_event(self, r, live: dict, ev) -> None:
        """The scheduler's thread: one of the window's requests moved (this must not block)."""
        rid = live["rid"]
        try:
            if ev.text:
                self.piece.emit(rid, ev.text)
            now = time.perf_counter()
            if ev.token is not None:
                if live["last"] is not None and now > live["last"]:
                    live["rates"].append(1.0 / (now - live["last"]))
                live["last"] = now
                if now - live["emitted"] >= 0.03:       # the window shows the newest every 40 ms
                    live["emitted"] = now
                    self.stats.emit(rid, json.dumps(self._request_stats(r, live)))
            if ev.finish is None:
                return
            self._app_requests.pop(r.id, None)
            if self._sreq is r:
                self._sreq = None
            if ev.finish == "error":
                self.failed.emit(rid, f"The answer failed: {ev.error}")
                return
            out = self._request_stats(r, live)
            reason = ev.finish
            if reason == "stop":
                reason = "constraint" if ev.stop_reason else "eos"
            elif reason == "length" and len(r.known) >= self.engine.n_ctx:
                reason = "context"
            out["stop_reason"] = reason
            out["dropped"] = live["dropped"]
            self.finished.emit(rid, json.dumps(out))
        except Exception:
            traceback.print_exc()

    def _request_stats(self, r, live: dict) -> dict:
        st = r.stats
        now = time.monotonic()
        first = st.first_token
        prompt_s = (first - st.arrival) if first else 0.0
        gen_s = ((st.finished or now) - first) if first else 0.0
        n = st.completion_tokens
        return {
            "prompt_tokens": st.prompt_tokens, "reused_tokens": st.cached_tokens,
            "prompt_tokens_per_s": (st.prompt_tokens - st.cached_tokens) / prompt_s if prompt_s > 0 else 0.0,
            "generated_tokens": n, "tokens_per_s": (n - 1) / gen_s if n > 1 and gen_s > 0 else 0.0,
            "rate_history": list(live["rates"][-200:]),
            "context_tokens": len(r.seq) if r.seq is not None else len(r.known), "n_ctx": self.engine.n_ctx,
            "speculative": {}, "kv": self.engine.stats(),
        }

    def _on_scheduler_step(self, sch) -> None:
        """The scheduler's thread, after each iteration: what is in flight, for the window."""
        rows = []
        now = time.monotonic()
        for state, reqs in (("running", list(sch.running)), ("waiting", list(sch.waiting))):
            for r in reqs:
                rows.append({"id": r.id, "state": state, "source": "chat" if r.id in self._app_requests else "API",
                             "prompt_tokens": r.stats.prompt_tokens, "cached_tokens": r.stats.cached_tokens,
                             "generated_tokens": r.stats.completion_tokens, "max_tokens": r.max_tokens,
                             "seconds": now - r.stats.arrival})
        ids = {row["id"] for row in rows}
        self._served += len(self._in_flight - ids)
        self._in_flight = ids
        self.server_snapshot = {"running": sch.stats.running, "waiting": sch.stats.waiting,
                                "served": self._served, "requests": rows, "kv": dict(sch.stats.kv)}

    def _on_step(self, gen) -> None:
        now = time.perf_counter()
        if self._last_step is not None:
            dt = now - self._last_step
            if dt > 0:
                self._rates.append(1.0 / dt)
        self._last_step = now
        self.stats.emit(self._rid, json.dumps(self._live_stats(gen)))

    def _live_stats(self, gen) -> dict:
        st = gen.stats
        eng = self.engine
        seq = gen.seq
        return {
            "prompt_tokens": st.prompt_tokens, "reused_tokens": st.reused_tokens,
            "prompt_tokens_per_s": st.prompt_tokens_per_s, "generated_tokens": st.generated_tokens,
            "tokens_per_s": st.tokens_per_s, "rate_history": list(self._rates[-200:]),
            "context_tokens": len(seq) if seq is not None else 0, "n_ctx": eng.n_ctx,
            "speculative": self._spec(gen), "kv": eng.stats(),
        }


    @staticmethod
    def _spec(gen) -> dict:
        """The draft's live numbers (the Generation copies them only at its end)."""
        d = getattr(gen, "drafter", None)
        if d is not None and hasattr(d, "stats"):
            return d.stats.as_dict()
        return dict(gen.stats.speculative or {})
