"""The live engine panel: what the engine is doing while it answers — KV cache
(bytes and blocks in use, reused prefix, what stays cached, capacity), context
used against the limit, prompt and generation speed, the device, the draft
model's acceptance rate, and a sparkline of tokens/s over the answer.

It only formats numbers the worker sends (engine.stats() and the Generation's
stats); it never asks the engine anything itself.

Below them, the local server: a switch, its URL, its API key (copyable) and the
requests in flight on its scheduler (running and waiting), which the window hands
over a few times a second while the server is on.
"""
from __future__ import annotations

from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QColor, QGuiApplication, QPainter, QPainterPath, QPen
from PySide6.QtWidgets import (QCheckBox, QFormLayout, QFrame, QHBoxLayout, QLabel, QLineEdit, QProgressBar,
                               QPushButton, QSizePolicy, QVBoxLayout, QWidget)

MAX_REQUEST_ROWS = 8


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else str(n)


class Sparkline(QWidget):
    """Tokens/s of each decode step over the current answer."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.values: list[float] = []
        self.colour = QColor("#2563eb")
        self.setMinimumHeight(44)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def set_values(self, values) -> None:
        self.values = list(values)[-120:]
        self.update()

    def paintEvent(self, _):
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        r = QRectF(self.rect()).adjusted(1, 3, -1, -3)
        grid = QColor(self.palette().color(self.foregroundRole()))
        grid.setAlpha(40)
        p.setPen(QPen(grid, 1))
        p.drawLine(r.bottomLeft(), r.bottomRight())
        if len(self.values) < 2:
            return
        top = max(self.values) * 1.1 or 1.0
        dx = r.width() / (len(self.values) - 1)
        pts = [QPointF(r.left() + i * dx, r.bottom() - r.height() * min(v / top, 1.0))
               for i, v in enumerate(self.values)]
        path = QPainterPath(pts[0])
        for q in pts[1:]:
            path.lineTo(q)
        fill = QPainterPath(path)
        fill.lineTo(pts[-1].x(), r.bottom())
        fill.lineTo(pts[0].x(), r.bottom())
        area = QColor(self.colour)
        area.setAlpha(50)
        p.fillPath(fill, area)
        p.setPen(QPen(self.colour, 1.6))
        p.drawPath(path)


class EngineBar(QProgressBar):
    def __init__(self):
        super().__init__()
        self.setTextVisible(False)
        self.setFixedHeight(6)
        self.setRange(0, 1000)


class EnginePanel(QFrame):
    server_toggled = Signal(bool)     # the user flipped the local server's switch

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("enginePanel")
        self.setMinimumWidth(250)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(12, 10, 12, 10)
        title = QLabel("<b>Engine</b>")
        lay.addWidget(title)
        form = QFormLayout()
        form.setLabelAlignment(Qt.AlignmentFlag.AlignLeft)
        form.setHorizontalSpacing(10)
        form.setVerticalSpacing(5)

        def row(name, tip):
            lab = QLabel("—")
            lab.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            lab.setWordWrap(True)
            lab.setToolTip(tip)
            form.addRow(name, lab)
            return lab

        self.model_label = row("Model", "the loaded model")
        self.device_label = row("Device", "where the model runs")
        self.kv_label = row("KV in use", "key/value cache held by live sequences: bytes and blocks")
        self.kv_bar = EngineBar()
        form.addRow("", self.kv_bar)
        self.reused_label = row("Reused prefix", "prompt tokens whose K/V came from the prefix cache this turn")
        self.cached_label = row("Cached", "blocks kept for prefix reuse by no live sequence (evicted when needed)")
        self.capacity_label = row("Capacity", "the whole KV pool")
        self.ctx_label = row("Context", "tokens of this conversation in the cache, against the context length")
        self.ctx_bar = EngineBar()
        form.addRow("", self.ctx_bar)
        self.prompt_label = row("Prompt", "prompt tokens computed this turn and their speed")
        self.gen_label = row("Generation", "tokens generated this turn and their speed")
        self.draft_label = row("Draft accept", "speculative decoding: share of drafted tokens the model accepted")
        lay.addLayout(form)
        lay.addWidget(QLabel("tokens/s over this answer"))
        self.sparkline = Sparkline()
        lay.addWidget(self.sparkline)
        lay.addSpacing(10)
        lay.addWidget(self._build_server())
        lay.addStretch(1)
        self.shown: dict = {}        # the last numbers shown, for tests and the About box
        self.set_server_state("off")

    def _build_server(self) -> QWidget:
        box = QWidget()
        v = QVBoxLayout(box)
        v.setContentsMargins(0, 0, 0, 0)
        v.setSpacing(5)
        self.server_switch = QCheckBox("Local server")
        self.server_switch.setToolTip("Serve the loaded model to other programs on 127.0.0.1: an "
                                      "OpenAI-compatible API with an API key; this chat keeps working beside it")
        font = self.server_switch.font()
        font.setBold(True)
        self.server_switch.setFont(font)
        self.server_switch.clicked.connect(lambda *_: self.server_toggled.emit(self.server_switch.isChecked()))
        v.addWidget(self.server_switch)
        form = QFormLayout()
        form.setHorizontalSpacing(10)
        form.setVerticalSpacing(5)
        self.server_url = QLabel("—")
        self.server_url.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.server_url.setToolTip("the base URL for OpenAI clients (base_url)")
        form.addRow("URL", self.server_url)
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        self.server_key = QLineEdit()
        self.server_key.setReadOnly(True)
        self.server_key.setPlaceholderText("—")
        self.server_key.setToolTip("the API key clients send (Authorization: Bearer …); a new one each time")
        self.copy_key_button = QPushButton("Copy")
        self.copy_key_button.setToolTip("copy the API key to the clipboard")
        self.copy_key_button.clicked.connect(self.copy_key)
        row.addWidget(self.server_key, 1)
        row.addWidget(self.copy_key_button)
        form.addRow("API key", row)
        self.server_load = QLabel("—")
        self.server_load.setToolTip("requests on the engine now: computed at once (running) and queued (waiting)")
        form.addRow("Requests", self.server_load)
        v.addLayout(form)
        self.server_requests = QLabel("")
        self.server_requests.setWordWrap(True)
        self.server_requests.setTextFormat(Qt.TextFormat.PlainText)
        self.server_requests.setToolTip("each request in flight: who sent it, its state, prompt tokens (those from "
                                        "the prefix cache) + generated / at most, time since it arrived")
        v.addWidget(self.server_requests)
        return box

    # ---- the local server ----------------------------------------------------
    def set_server_state(self, state: str, info: dict | None = None) -> None:
        """state: off | starting | on | stopping; info (on): url, api_key."""
        self.server_switch.blockSignals(True)
        self.server_switch.setChecked(state in ("starting", "on"))
        self.server_switch.blockSignals(False)
        self.server_switch.setEnabled(state in ("off", "on"))
        on = state == "on" and info is not None
        self.server_url.setText(info["url"] if on else {"starting": "starting…", "stopping": "stopping…"}.get(state, "off"))
        self.server_key.setText(info["api_key"] if on else "")
        self.server_key.setCursorPosition(0)
        self.copy_key_button.setEnabled(on)
        self.server_load.setText("0 running · 0 waiting" if on else "—")
        self.server_requests.setText("")
        self.shown["server"] = {"state": state, **(info or {})}

    def copy_key(self) -> None:
        if self.server_key.text():
            QGuiApplication.clipboard().setText(self.server_key.text())

    def set_server_requests(self, snap: dict) -> None:
        """The scheduler's requests in flight (the worker's snapshot)."""
        self.server_load.setText(f"{snap['running']} running · {snap['waiting']} waiting · {snap['served']} done")
        lines = []
        for r in snap["requests"][:MAX_REQUEST_ROWS]:
            who = "this chat" if r["source"] == "chat" else "API"
            cached = f" ({r['cached_tokens']} cached)" if r.get("cached_tokens") else ""   # prompt tokens
            lines.append(f"#{r['id']} {who} · {r['state']} · {r['prompt_tokens']}{cached} + "
                         f"{r['generated_tokens']}/{r['max_tokens']} tokens · {r['seconds']:.1f} s")
        more = len(snap["requests"]) - MAX_REQUEST_ROWS
        if more > 0:
            lines.append(f"… and {more} more")
        self.server_requests.setText("\n".join(lines))
        self.shown["server_requests"] = snap

    def set_colour(self, colour: str) -> None:
        self.sparkline.colour = QColor(colour)
        self.sparkline.update()

    def set_model(self, info: dict) -> None:
        active = info.get("n_active_params", info["n_params"])     # mixture of experts: what a token reads
        self.model_label.setText(f"{info['name']} · {info['arch']} · {human_count(info['n_params'])} params "
                                 + (f"({human_count(active)} active) " if active != info["n_params"] else "")
                                 + f"· {human_bytes(info['weight_bytes'])}")
        self.device_label.setText(info["device"])
        self.draft_label.setText(info.get("draft") or "no draft model")
        self.set_kv(info["kv"])
        self.ctx_label.setText(f"0 / {info['n_ctx']} tokens")
        self.ctx_bar.setValue(0)

    def set_kv(self, kv: dict, reused_tokens: int | None = None) -> None:
        bs = kv["block_size"]
        bpb = kv["bytes_used"] // kv["blocks_used"] if kv["blocks_used"] else kv["bytes_total"] // kv["blocks_total"]
        self.kv_label.setText(f"{human_bytes(kv['bytes_used'])} · {kv['blocks_used']} of {kv['blocks_total']} blocks")
        self.kv_bar.setValue(int(1000 * kv["blocks_used"] / max(kv["blocks_total"], 1)))
        self.cached_label.setText(f"{human_bytes(kv['bytes_cached'])} · {kv['blocks_cached']} blocks")
        kind = f" · {kv['cache_type']}" if kv.get("cache_type") else ""
        self.capacity_label.setText(f"{human_bytes(kv['bytes_total'])} · {kv['blocks_total']} × {bs} tokens "
                                    f"· {human_bytes(kv['bytes_per_token'])}/token{kind}")
        if reused_tokens is not None:
            self.reused_label.setText(f"{reused_tokens} tokens · {human_bytes(reused_tokens * kv['bytes_per_token'])}")
        self.shown["kv"] = kv
        self.shown["bytes_per_block"] = bpb

    def update_live(self, s: dict) -> None:
        """Called at most once per UI tick with the newest numbers from the worker."""
        self.set_kv(s["kv"], s["reused_tokens"])
        n, limit = s["context_tokens"], s["n_ctx"]
        self.ctx_label.setText(f"{n} / {limit} tokens ({100 * n / max(limit, 1):.0f}%)")
        self.ctx_bar.setValue(int(1000 * n / max(limit, 1)))
        computed = s["prompt_tokens"] - s["reused_tokens"]
        self.prompt_label.setText(f"{computed} tokens · {s['prompt_tokens_per_s']:.1f} t/s")
        self.gen_label.setText(f"{s['generated_tokens']} tokens · {s['tokens_per_s']:.1f} t/s")
        spec = s.get("speculative") or {}
        if spec.get("drafted"):
            rate = spec.get("accepted", 0) / spec["drafted"]
            self.draft_label.setText(f"{100 * rate:.0f}% ({spec.get('accepted', 0)}/{spec['drafted']})")
        self.sparkline.set_values(s.get("rate_history", []))
        self.shown.update(s)
