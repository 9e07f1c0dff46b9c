"""The main window: chats on the left, the conversation in the middle, the live
engine panel on the right.

The UI thread only renders.  Tokens arrive from the worker as queued signals
and are merely appended to a buffer; a 40 ms timer then (1) commits the answer
so far to SQLite and (2) re-renders the one streaming bubble and the engine
panel.  Saving before showing is what makes a kill mid-answer lose nothing that
was on screen.

Server ▸ Local server (or the switch in the engine panel) serves the loaded model
on 127.0.0.1 (see worker.py: the engine then belongs to the server's scheduler and
this window's turns go through it too); a 250 ms timer shows its requests in flight.
"""
from __future__ import annotations

import json
import platform
import time

from PySide6.QtCore import Qt, QThread, QTimer, Signal, Slot
from PySide6.QtGui import QAction, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (QApplication, QFileDialog, QHBoxLayout, QInputDialog, QLabel, QLineEdit,
                               QListWidget, QListWidgetItem, QMainWindow, QMessageBox, QPlainTextEdit,
                               QProgressBar, QProgressDialog, QPushButton, QSplitter, QVBoxLayout, QWidget)

from models.catalog import CATALOG

from . import __version__, theme
from .chat_view import ChatView
from .engine_panel import EnginePanel, human_bytes
from .paths import chats_db
from .settings import Settings, load_settings, save_settings
from .settings_dialog import SettingsDialog
from .store import ChatStore, Message
from .worker import EngineWorker

FLUSH_MS = 40
SERVER_REFRESH_MS = 250
_THREADS: list = []          # worker threads still finishing a step when their window closed


class Composer(QPlainTextEdit):
    """Enter sends, Shift+Enter adds a new line, Esc cancels an edit or stops."""
    submit = Signal()
    escape = Signal()

    def keyPressEvent(self, e):
        if e.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if e.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
            else:
                self.submit.emit()
            return
        if e.key() == Qt.Key.Key_Escape:
            self.escape.emit()
            return
        super().keyPressEvent(e)


class MainWindow(QMainWindow):
    request_load = Signal(str)          # JSON for the worker thread (see worker.py on why)
    request_generate = Signal(str)
    request_shutdown = Signal()
    request_server_start = Signal(str)
    request_server_stop = Signal()

    def __init__(self, model: str | None = None, store: ChatStore | None = None, settings: Settings | None = None,
                 autoload: bool = True):
        super().__init__()
        self.settings = settings or load_settings()
        if model:
            self.settings.model = model
        self.store = store or ChatStore(chats_db())
        self.look = theme.resolve(self.settings.theme)
        self.model_info: dict | None = None
        self.loading = False
        self.busy = False
        self.req_id = 0
        self.chat_id: int | None = None
        self.messages: list[Message] = []
        self.editing: int | None = None         # position of the user message being edited
        self.stream_msg: Message | None = None
        self.stream_view = None
        self.stream_text = ""
        self._dirty = False
        self._live: dict | None = None
        self.last_error = ""
        self.error_box: QMessageBox | None = None
        self.stop_requested_at: float | None = None
        self.last_final: dict = {}
        self._download: QProgressDialog | None = None
        self.server_state = "off"               # off | starting | on | stopping
        self.server_info: dict = {}             # url, api_key, model while on
        self._server_shown = None

        self.setWindowTitle("Llamba")
        self.resize(1180, 760)
        self._build()
        self._build_menus()
        self.apply_look()
        self._start_worker()
        self.flush_timer = QTimer(self)
        self.flush_timer.setInterval(FLUSH_MS)
        self.flush_timer.timeout.connect(self.flush)
        self.server_timer = QTimer(self)
        self.server_timer.setInterval(SERVER_REFRESH_MS)
        self.server_timer.timeout.connect(self.refresh_server)
        hints = QGuiApplication.styleHints()
        if hasattr(hints, "colorSchemeChanged"):
            hints.colorSchemeChanged.connect(lambda *_: self.settings.theme == "system" and self.apply_look())
        self.refresh_chats()
        chats = self.store.chats()
        self.open_chat(chats[0].id if chats else self.store.new_chat(system=self.settings.default_system))
        if autoload:
            self.load_model()

    # ---- layout ------------------------------------------------------------------
    def _build(self) -> None:
        split = QSplitter(Qt.Orientation.Horizontal)
        split.setChildrenCollapsible(False)

        side = QWidget()
        sl = QVBoxLayout(side)
        sl.setContentsMargins(8, 8, 4, 8)
        self.new_button = QPushButton("+  New chat")
        self.new_button.clicked.connect(self.new_chat)
        sl.addWidget(self.new_button)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search chats")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self.refresh_chats)
        sl.addWidget(self.search)
        self.chat_list = QListWidget()
        self.chat_list.itemClicked.connect(lambda it: self.open_chat(it.data(Qt.ItemDataRole.UserRole)))
        self.chat_list.itemDoubleClicked.connect(lambda _: self.rename_chat())
        self.chat_list.setContextMenuPolicy(Qt.ContextMenuPolicy.ActionsContextMenu)
        sl.addWidget(self.chat_list, 1)
        side.setMinimumWidth(170)
        split.addWidget(side)

        mid = QWidget()
        ml = QVBoxLayout(mid)
        ml.setContentsMargins(4, 8, 4, 8)
        self.system_edit = QLineEdit()
        self.system_edit.setPlaceholderText("System prompt for this chat (optional)")
        self.system_edit.editingFinished.connect(self._save_system)
        ml.addWidget(self.system_edit)
        self.banner = QWidget()
        bl = QHBoxLayout(self.banner)
        bl.setContentsMargins(4, 2, 4, 2)
        self.banner_label = QLabel("")
        self.banner_label.setWordWrap(True)
        self.banner_bar = QProgressBar()
        self.banner_bar.setRange(0, 0)
        self.banner_bar.setMaximumWidth(160)
        self.banner_bar.setTextVisible(False)
        bl.addWidget(self.banner_label, 1)
        bl.addWidget(self.banner_bar)
        self.banner.hide()
        ml.addWidget(self.banner)
        self.view = ChatView()
        self.view.edit_requested.connect(self.begin_edit)
        self.view.regenerate_requested.connect(self.regenerate)
        ml.addWidget(self.view, 1)
        self.notice = QLabel("")
        self.notice.setWordWrap(True)
        self.notice.hide()
        ml.addWidget(self.notice)
        self.edit_banner = QLabel("Editing a message — Enter answers again from it, Esc cancels.")
        self.edit_banner.hide()
        ml.addWidget(self.edit_banner)
        row = QHBoxLayout()
        self.composer = Composer()
        self.composer.setPlaceholderText("Message Llamba…  (Enter sends, Shift+Enter new line)")
        self.composer.setFixedHeight(78)
        self.composer.submit.connect(self.send)
        self.composer.escape.connect(self._escape)
        row.addWidget(self.composer, 1)
        col = QVBoxLayout()
        self.send_button = QPushButton("Send")
        self.send_button.setDefault(True)
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        self.stop_button.setEnabled(False)
        col.addWidget(self.send_button)
        col.addWidget(self.stop_button)
        row.addLayout(col)
        ml.addLayout(row)
        split.addWidget(mid)

        self.panel = EnginePanel()
        self.panel.server_toggled.connect(self.set_server)
        split.addWidget(self.panel)
        split.setStretchFactor(0, 0)
        split.setStretchFactor(1, 1)
        split.setStretchFactor(2, 0)
        split.setSizes([220, 640, 300])
        self.panel.setVisible(self.settings.show_engine_panel)
        self.setCentralWidget(split)
        self.status_label = QLabel("")
        self.statusBar().addWidget(self.status_label, 1)

    def _act(self, menu, text, slot, shortcut=None, tip=None) -> QAction:
        a = QAction(text, self)
        if shortcut:
            a.setShortcut(QKeySequence(shortcut))
        if tip:
            a.setStatusTip(tip)
        a.triggered.connect(slot)
        menu.addAction(a)
        return a

    def _build_menus(self) -> None:
        mb = self.menuBar()
        f = mb.addMenu("&File")
        self._act(f, "&New chat", self.new_chat, "Ctrl+N")
        self._act(f, "&Open model…", self.open_model_file, "Ctrl+O")
        self.recent_menu = f.addMenu("Recent models")
        self.catalog_menu = f.addMenu("Catalog models")
        self.recent_menu.aboutToShow.connect(self._fill_recent)
        self.catalog_menu.aboutToShow.connect(self._fill_catalog)
        f.addSeparator()
        self._act(f, "&Settings…", self.open_settings, "Ctrl+,")
        f.addSeparator()
        self._act(f, "&Quit", self.close, "Ctrl+Q")
        c = mb.addMenu("&Chat")
        self.stop_action = self._act(c, "&Stop", self.stop, "Esc")
        self._act(c, "&Regenerate answer", self.regenerate, "Ctrl+R")
        self._act(c, "&Edit last message", self.edit_last, "Ctrl+Up")
        self._act(c, "C&lear chat", self.clear_chat, "Ctrl+L")
        c.addSeparator()
        rename = self._act(c, "Re&name chat…", self.rename_chat, "F2")
        delete = self._act(c, "&Delete chat", self.delete_chat, "Ctrl+Shift+D")
        self._act(c, "&Find chat", lambda: self.search.setFocus(), "Ctrl+F")
        self.chat_list.addAction(rename)
        self.chat_list.addAction(delete)
        sv = mb.addMenu("Se&rver")
        self.server_action = self._act(sv, "&Local server", self.set_server, "Ctrl+Shift+L",
                                       "Serve the loaded model to other programs on 127.0.0.1 (OpenAI-compatible)")
        self.server_action.setCheckable(True)
        self.copy_url_action = self._act(sv, "Copy server &URL", lambda: self._copy(self.server_info.get("url")))
        self.copy_key_action = self._act(sv, "Copy API &key", lambda: self._copy(self.server_info.get("api_key")))
        self._sync_server_ui()
        v = mb.addMenu("&View")
        self._act(v, "Engine &panel", self.toggle_panel, "Ctrl+E")
        h = mb.addMenu("&Help")
        self._act(h, "&About Llamba", self.about, "F1")

    def apply_look(self, choice: str | None = None) -> None:
        """Apply the Settings' theme (or `choice` for this session only)."""
        self.look = theme.resolve(choice or self.settings.theme)
        theme.apply(QApplication.instance(), self.look)
        colours = theme.BUBBLE[self.look]
        self.view.set_look(colours, theme.markdown_palette(self.look))
        self.panel.set_colour(colours["spark"])
        self.notice.setStyleSheet(f"color: {colours['accent']}; padding: 2px 6px;")
        self.edit_banner.setStyleSheet(f"color: {colours['accent']}; padding: 2px 6px;")
        if self.chat_id is not None and not self.busy:
            self._show_messages()

    # ---- worker ------------------------------------------------------------------
    def _start_worker(self) -> None:
        self.thread = QThread()
        self.thread.setObjectName("llamba-engine")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        self.request_load.connect(self.worker.load)
        self.request_generate.connect(self.worker.generate)
        self.request_shutdown.connect(self.worker.shut_down)
        w = self.worker
        w.status.connect(self._on_status)
        w.download_progress.connect(self._on_download)
        w.loaded.connect(self._on_loaded)
        w.load_failed.connect(self._on_load_failed)
        w.piece.connect(self._on_piece)
        w.stats.connect(self._on_stats)
        w.finished.connect(self._on_finished)
        w.failed.connect(self._on_failed)
        self.request_server_start.connect(self.worker.start_server)
        self.request_server_stop.connect(self.worker.stop_server)
        w.server_started.connect(self._on_server_started)
        w.server_stopped.connect(self._on_server_stopped)
        self.thread.started.connect(self.worker.lower_priority)
        self.thread.start()

    def load_model(self, model: str | None = None) -> None:
        if model:
            self.settings.model = model
        if self.busy:
            self.stop()
        s = self.settings
        self.loading = True
        self.model_info = None
        self._set_banner(f"Loading {s.model}…")
        self._update_buttons()
        self.request_load.emit(json.dumps({"model": s.model, "device": s.device, "gpu_layers": s.gpu_layers,
                                           "cpu_moe": s.cpu_moe,
                                           "n_ctx": s.n_ctx, "draft_model": s.draft_model,
                                           "overflow": s.overflow}))

    def _set_banner(self, text: str | None) -> None:
        if text:
            self.banner_label.setText(text)
            self.banner.show()
        else:
            self.banner.hide()

    @Slot(str)
    def _on_status(self, text: str) -> None:
        self.status_label.setText(text)
        if self.loading:
            self._set_banner(text)

    @Slot(float, float, str)
    def _on_download(self, done, total, label) -> None:
        if self._download is None:
            self._download = QProgressDialog(f"Downloading {label}…", "", 0, 1000, self)
            self._download.setWindowTitle("Downloading model")
            self._download.setCancelButton(None)
            self._download.setMinimumDuration(0)
            self._download.setWindowModality(Qt.WindowModality.WindowModal)
            self._download.setAutoReset(False)     # it closes when the model has loaded
            self._download.setAutoClose(False)
            self._download.show()
        self._download.setLabelText(f"Downloading {label}: {human_bytes(done)} of {human_bytes(total)}")
        self._download.setValue(int(1000 * done / total) if total else 0)

    def _close_download(self) -> None:
        if self._download is not None:
            self._download.close()
            self._download.deleteLater()
            self._download = None

    @Slot(str)
    def _on_loaded(self, info_json: str) -> None:
        info = json.loads(info_json)
        self._close_download()
        self.loading = False
        self.model_info = info
        self.settings.add_recent(self.settings.model)
        save_settings(self.settings)
        self._set_banner(None)
        self.panel.set_model(info)
        self.setWindowTitle(f"Llamba — {info['name']}")
        warm = f", kernels ready in {info['warmup_seconds']:.1f} s" if info["warmup_seconds"] > 0.05 else ""
        self.status_label.setText(f"Ready: {info['name']} on {info['device']} (loaded in "
                                  f"{info['load_seconds']:.1f} s{warm})")
        self._update_buttons()

    @Slot(str)
    def _on_load_failed(self, msg: str) -> None:
        self._close_download()
        self.loading = False
        self._set_banner(None)
        self.status_label.setText("No model loaded — choose one with File ▸ Open model… (Ctrl+O)")
        self.show_error("The model could not be loaded", msg)
        self._update_buttons()

    def show_error(self, title: str, msg: str) -> None:
        """A window-modal message box that does not block the event loop."""
        self.last_error = msg
        box = QMessageBox(QMessageBox.Icon.Critical, title, msg, QMessageBox.StandardButton.Ok, self)
        box.setWindowModality(Qt.WindowModality.WindowModal)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.error_box = box
        box.finished.connect(lambda *_: setattr(self, "error_box", None))
        box.open()

    def _update_buttons(self) -> None:
        ready = self.model_info is not None and not self.loading
        self.send_button.setEnabled(ready and not self.busy)
        self.stop_button.setEnabled(self.busy)
        self.new_button.setEnabled(not self.busy)
        self.view.set_busy(self.busy)

    # ---- chats -------------------------------------------------------------------
    def refresh_chats(self) -> None:
        self.chat_list.clear()
        for c in self.store.chats(self.search.text().strip()):
            it = QListWidgetItem(c.title)
            it.setData(Qt.ItemDataRole.UserRole, c.id)
            it.setToolTip(time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated)))
            self.chat_list.addItem(it)
            if c.id == self.chat_id:
                it.setSelected(True)
                self.chat_list.setCurrentItem(it)

    def open_chat(self, chat_id: int) -> None:
        if self.busy:
            return
        chat = self.store.chat(chat_id)
        if chat is None:
            return
        self.chat_id = chat_id
        self.system_edit.setText(chat.system)
        self._cancel_edit()
        self.notice.hide()
        self._show_messages()
        self.refresh_chats()

    def _show_messages(self) -> None:
        self.messages = self.store.messages(self.chat_id)
        self.view.clear()
        for m in self.messages:
            v = self.view.add(m.role, m.position, m.content)
            if not m.complete:
                v.note.setText("(interrupted)")

    def new_chat(self) -> None:
        if self.busy:
            return
        self.open_chat(self.store.new_chat(system=self.settings.default_system))
        self.composer.setFocus()

    def rename_chat(self, title: str | None = None) -> None:
        if self.chat_id is None:
            return
        if title is None:
            current = self.store.chat(self.chat_id).title
            title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=current)
            if not ok:
                return
        self.store.rename(self.chat_id, title)
        self.refresh_chats()

    def delete_chat(self, confirm: bool = True) -> None:
        if self.chat_id is None or self.busy:
            return
        if confirm and QMessageBox.question(self, "Delete chat", "Delete this chat and all its messages?") \
                != QMessageBox.StandardButton.Yes:
            return
        self.store.delete(self.chat_id)
        chats = self.store.chats()
        self.chat_id = None
        self.open_chat(chats[0].id if chats else self.store.new_chat(system=self.settings.default_system))

    def clear_chat(self) -> None:
        if self.chat_id is None or self.busy:
            return
        self.store.clear(self.chat_id)
        self._cancel_edit()
        self.notice.hide()
        self._show_messages()

    def _save_system(self) -> None:
        if self.chat_id is not None:
            self.store.set_system(self.chat_id, self.system_edit.text())

    # ---- asking ------------------------------------------------------------------
    def send(self, text: str | None = None) -> bool:
        """Send the composer's text (or `text`); returns whether an answer started."""
        if text is None or isinstance(text, bool):
            text = self.composer.toPlainText()
        text = text.strip()
        if not text or self.busy or self.model_info is None:
            return False
        self.composer.clear()
        if self.editing is not None:
            return self._resend_edit(text)
        if not self.messages and self.store.chat(self.chat_id).title == "New chat":
            self.store.rename(self.chat_id, text.splitlines()[0][:48])
            self.refresh_chats()
        m = self.store.add(self.chat_id, "user", text)
        self.messages.append(m)
        self.view.add("user", m.position, text)
        self._ask("send")
        return True

    def regenerate(self) -> bool:
        if self.busy or self.model_info is None or not self.messages:
            return False
        old = ""
        if self.messages[-1].role == "assistant":
            last = self.messages.pop()
            old = last.content
            self.store.truncate(self.chat_id, last.position)
            self.view.truncate(last.position)
        if not self.messages or self.messages[-1].role != "user":
            return False
        self._ask("regenerate", old_answer=old)
        return True

    def begin_edit(self, position: int) -> None:
        if self.busy:
            return
        m = next((m for m in self.messages if m.position == position and m.role == "user"), None)
        if m is None:
            return
        self.editing = position
        self.composer.setPlainText(m.content)
        self.composer.setFocus()
        self.edit_banner.show()

    def edit_last(self) -> None:
        users = [m for m in self.messages if m.role == "user"]
        if users:
            self.begin_edit(users[-1].position)

    def _cancel_edit(self) -> None:
        if self.editing is not None:
            self.composer.clear()
        self.editing = None
        self.edit_banner.hide()

    def _escape(self) -> None:
        if self.busy:
            self.stop()
        else:
            self._cancel_edit()

    def _resend_edit(self, text: str) -> bool:
        pos = self.editing
        self.editing = None
        self.edit_banner.hide()
        i = next(i for i, m in enumerate(self.messages) if m.position == pos)
        old = self.messages[i].content
        self.store.truncate(self.chat_id, pos + 1)
        self.store.update(self.messages[i].id, text, complete=True)
        self.messages[i].content = text
        del self.messages[i + 1:]
        self.view.truncate(pos + 1)
        self.view.views[-1].set_text(text)
        self._ask("edit", old_text=old)
        return True

    def _ask(self, kind: str, **extra) -> None:
        s = self.settings
        history = [m.as_turn() for m in self.messages]
        self.stream_msg = self.store.add(self.chat_id, "assistant", "", complete=False)
        self.messages.append(self.stream_msg)
        self.stream_view = self.view.add("assistant", self.stream_msg.position, "")
        self.stream_view.note.setText("thinking…")
        self.stream_text = ""
        self._dirty = False
        self._live = None
        self.stop_requested_at = None
        self.req_id += 1
        self.busy = True
        self.notice.hide()
        self._update_buttons()
        self.request_generate.emit(json.dumps({
            "id": self.req_id, "chat_id": self.chat_id, "kind": kind, "system": self.system_edit.text().strip(), "history": history,
            "params": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
                       "repeat_penalty": s.repeat_penalty, "json_schema": s.json_schema},
            "max_tokens": s.max_tokens, "overflow": s.overflow, **extra}))
        self.flush_timer.start()

    def stop(self) -> None:
        if self.busy:
            self.stop_requested_at = time.perf_counter()
            self.worker.request_stop()
            self.status_label.setText("Stopping…")

    # ---- streaming (UI thread; each slot is a few Python operations) --------------
    @Slot(int, str)
    def _on_piece(self, rid: int, text: str) -> None:
        if rid == self.req_id:
            self.stream_text += text
            self._dirty = True

    @Slot(int, str)
    def _on_stats(self, rid: int, s: str) -> None:
        if rid == self.req_id:
            self._live = s          # parsed at the next tick: only the newest is ever shown

    def flush(self) -> None:
        """Commit, then show: the answer so far and the newest engine numbers."""
        if self._dirty and self.stream_msg is not None:
            self.store.update(self.stream_msg.id, self.stream_text, complete=False)
            self.stream_msg.content = self.stream_text
            self.stream_view.set_text(self.stream_text, final=False)
            self.stream_view.note.setText("thinking…" if self.stream_view.thinking else "")
            self._dirty = False
        if self._live is not None:
            self.panel.update_live(json.loads(self._live))
            self._live = None

    @Slot(int, str)
    def _on_finished(self, rid: int, final_json: str) -> None:
        if rid != self.req_id:
            return
        self._live = final_json
        final = json.loads(final_json)
        self.flush()
        self.flush_timer.stop()
        self.last_final = final
        self.store.update(self.stream_msg.id, self.stream_text, complete=True,
                          stats={k: final[k] for k in ("prompt_tokens", "generated_tokens", "tokens_per_s",
                                                       "prompt_tokens_per_s", "stop_reason")})
        self.stream_msg.complete = True
        self.stream_view.set_text(self.stream_text)         # (whole: a tail held as a possible marker shows)
        reason = final.get("stop_reason", "")
        note = {"cancelled": "stopped", "length": "max tokens reached", "context": "context full"}.get(reason, "")
        self.stream_view.note.setText(note)
        if reason == "context":
            self._notify(f"The context is full ({final['context_tokens']} of {final['n_ctx']} tokens): the answer "
                         f"was cut off. Start a new chat or raise the context length in Settings.")
        elif final.get("dropped"):
            self._notify(f"The conversation did not fit the context: its {final['dropped']} oldest turn(s) "
                         f"are no longer in the prompt.")
        self.status_label.setText(f"{final['generated_tokens']} tokens at {final['tokens_per_s']:.1f} t/s"
                                  + (f" — {note}" if note else ""))
        self._end_stream()

    @Slot(int, str)
    def _on_failed(self, rid: int, msg: str) -> None:
        if rid != self.req_id:
            return
        self.flush()
        self.flush_timer.stop()
        if self.stream_msg is not None and not self.stream_text:
            # nothing was said: leave no empty answer behind
            self.store.truncate(self.chat_id, self.stream_msg.position)
            self.view.truncate(self.stream_msg.position)
            self.messages.pop()
        elif self.stream_msg is not None:
            self.stream_view.note.setText("(failed)")
        self._notify(msg)
        self.show_error("The answer failed", msg)
        self._end_stream()

    def _notify(self, text: str) -> None:
        self.notice.setText(text)
        self.notice.show()

    def _end_stream(self) -> None:
        self.stream_msg = self.stream_view = None
        self.busy = False
        self.refresh_chats()
        self._update_buttons()

    # ---- model choice, settings, about -------------------------------------------
    def open_model_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a model", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.load_model(path)

    def _fill_recent(self) -> None:
        self.recent_menu.clear()
        for m in self.settings.recent_models or []:
            self.recent_menu.addAction(m, lambda m=m: self.load_model(m))
        if not self.settings.recent_models:
            self.recent_menu.addAction("(none yet)").setEnabled(False)

    def _fill_catalog(self) -> None:
        from runtime.download import cached_path
        self.catalog_menu.clear()
        for name, m in CATALOG.items():
            mark = "" if cached_path(name) else f"  (download {human_bytes(m.size)})"
            a = self.catalog_menu.addAction(f"{name}{mark}", lambda n=name: self.load_model(n))
            a.setToolTip(m.description)

    def open_settings(self) -> None:
        dlg = SettingsDialog(self.settings, self)
        if dlg.exec():
            self.apply_settings(dlg.result_settings())

    def apply_settings(self, new: Settings) -> None:
        reload = new.engine_key() != self.settings.engine_key()
        new_port = new.server_port != self.settings.server_port
        self.settings = new
        save_settings(new)
        self.apply_look()
        if reload:
            self.load_model()           # (the worker turns the server off first)
        elif new_port and self.server_state == "on":
            self.set_server(False)
            self.set_server(True)       # queued after the stop in the worker's thread

    def toggle_panel(self) -> None:
        self.settings.show_engine_panel = not self.panel.isVisible()
        self.panel.setVisible(self.settings.show_engine_panel)
        save_settings(self.settings)

    def about_text(self) -> str:
        import numba
        import numpy
        import PySide6
        from PySide6.QtCore import qVersion
        info = self.model_info
        model = f"{info['name']} ({info['arch']}) on {info['device']}" if info else "none loaded"
        return (f"<h3>Llamba {__version__}</h3><p>Local LLM inference on your own computer.</p>"
                f"<p>Python {platform.python_version()} · PySide6 {PySide6.__version__} (Qt {qVersion()}) · "
                f"NumPy {numpy.__version__} · Numba {numba.__version__}<br>"
                f"{platform.system()} {platform.machine()}</p><p>Model: {model}</p>")

    def about(self) -> None:
        QMessageBox.about(self, "About Llamba", self.about_text())

    # ---- the local server --------------------------------------------------------
    def set_server(self, on: bool) -> None:
        """Turn the local server on or off (the menu's action and the panel's switch)."""
        on = bool(on)
        if on and self.server_state in ("off", "stopping"):
            if self.model_info is None or self.loading:
                self.status_label.setText("Load a model first: the local server serves the loaded model")
                self._sync_server_ui()
                return
            self.server_state = "starting"
            self.request_server_start.emit(json.dumps({"port": self.settings.server_port}))
        elif not on and self.server_state in ("on", "starting"):
            self.server_state = "stopping"
            self.request_server_stop.emit()
        self._sync_server_ui()

    def _sync_server_ui(self) -> None:
        st = self.server_state
        self.server_action.blockSignals(True)
        self.server_action.setChecked(st in ("starting", "on"))
        self.server_action.blockSignals(False)
        self.copy_url_action.setEnabled(st == "on")
        self.copy_key_action.setEnabled(st == "on")
        self.panel.set_server_state(st, self.server_info if st == "on" else None)

    @Slot(str)
    def _on_server_started(self, info_json: str) -> None:
        self.server_info = json.loads(info_json)
        if self.server_state == "stopping":
            return                      # turned off again before it came up: the stop is queued
        self.server_state = "on"
        self._server_shown = None
        self._sync_server_ui()
        self.status_label.setText(f"Serving {self.server_info['model']} at {self.server_info['url']}")
        self.server_timer.start()

    @Slot(str)
    def _on_server_stopped(self, why: str) -> None:
        self.server_timer.stop()
        self.server_info = {}
        if self.server_state == "starting" and not why:
            return                      # a stop from before this start's request (a restart)
        self.server_state = "off"
        self._sync_server_ui()
        if why:
            self.show_error("The local server is off", why)

    def refresh_server(self) -> None:
        """The worker's newest snapshot of the requests in flight, if it changed."""
        snap = self.worker.server_snapshot
        if snap is not None and snap is not self._server_shown and self.server_state == "on":
            self._server_shown = snap
            self.panel.set_server_requests(snap)

    def _copy(self, text: str | None) -> None:
        if text:
            QGuiApplication.clipboard().setText(text)

    # ---- shutdown ----------------------------------------------------------------
    def closeEvent(self, e):
        self.server_timer.stop()
        self.worker.request_stop()
        self.flush()
        save_settings(self.settings)
        self.request_shutdown.emit()          # queued after any running answer; ends the thread
        if not self.thread.wait(3000):
            # a load or a long step is still running: let it finish in the background
            _THREADS.append((self.thread, self.worker))
        super().closeEvent(e)

