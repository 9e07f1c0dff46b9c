"""The conversation: one bubble per message in a scroll area.  Only the bubble
that is streaming is re-rendered while an answer arrives, so a long chat costs
no more per update than a short one."""
from __future__ import annotations

import math

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication, QTextOption
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QScrollArea, QSizePolicy, QTextBrowser,
                               QToolButton, QVBoxLayout, QWidget)

from runtime import reasoning

from . import markdown


class AutoHeightBrowser(QTextBrowser):
    """A QTextBrowser as tall as its document, so the scroll area does the scrolling."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setOpenLinks(False)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setWordWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        self.viewport().setAutoFillBackground(False)
        self.setStyleSheet("QTextBrowser { background: transparent; }")
        self.document().setDocumentMargin(2)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)

    def _fit(self, *_):
        h = math.ceil(self.document().size().height()) + self.contentsMargins().top() + self.contentsMargins().bottom()
        if h != self.height():
            self.setFixedHeight(max(h, 20))

    def resizeEvent(self, e):
        super().resizeEvent(e)
        self.document().setTextWidth(self.viewport().width())
        self._fit()


class MessageView(QFrame):
    edit_clicked = Signal(int)          # position
    regenerate_clicked = Signal()

    def __init__(self, role: str, position: int, colours: dict, md_palette):
        super().__init__()
        self.role, self.position = role, position
        self.text = ""              # what Copy copies: the answer (a model's reasoning left out)
        self.raw = ""               # the message as stored (reasoning markers and all)
        self.thinking = False       # the answer so far ends inside the model's reasoning
        self.codes: list[str] = []
        self.md_palette = md_palette
        self.setObjectName("bubble")
        bg = colours["user"] if role == "user" else colours["assistant"]
        self.setStyleSheet(f"#bubble {{ background: {bg}; border: 1px solid {colours['border']}; "
                           f"border-radius: 10px; }}")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(12, 6, 12, 8)
        lay.setSpacing(2)
        head = QHBoxLayout()
        self.who = QLabel({"user": "You", "assistant": "Llamba", "system": "System"}.get(role, role))
        self.who.setStyleSheet(f"color: {colours['muted']}; font-weight: 600;")
        head.addWidget(self.who)
        self.note = QLabel("")
        self.note.setStyleSheet(f"color: {colours['muted']};")
        head.addWidget(self.note)
        head.addStretch(1)
        self.buttons: dict[str, QToolButton] = {}
        for name, tip in (("Copy", "Copy the whole message"), ("Edit", "Edit this message and answer again"),
                          ("Regenerate", "Answer this again")):
            b = QToolButton()
            b.setText(name)
            b.setToolTip(tip)
            b.setAutoRaise(True)
            b.setCursor(Qt.CursorShape.PointingHandCursor)
            head.addWidget(b)
            self.buttons[name] = b
        self.buttons["Copy"].clicked.connect(lambda: QGuiApplication.clipboard().setText(self.text))
        self.buttons["Edit"].clicked.connect(lambda: self.edit_clicked.emit(self.position))
        self.buttons["Regenerate"].clicked.connect(self.regenerate_clicked.emit)
        self.buttons["Edit"].setVisible(role == "user")
        self.buttons["Regenerate"].setVisible(False)
        lay.addLayout(head)
        # a model's reasoning (runtime/reasoning.py: Qwen3's <think>, gpt-oss's analysis
        # channel) apart from its answer, folded until asked for
        self.reasoning_toggle = QToolButton()
        self.reasoning_toggle.setCheckable(True)
        self.reasoning_toggle.setAutoRaise(True)
        self.reasoning_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.reasoning_toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.reasoning_toggle.setCursor(Qt.CursorShape.PointingHandCursor)
        self.reasoning_toggle.setStyleSheet(f"color: {colours['muted']};")
        self.reasoning_toggle.toggled.connect(self._fold)
        self.reasoning_toggle.hide()
        lay.addWidget(self.reasoning_toggle)
        self.reasoning = AutoHeightBrowser()
        self.reasoning.setStyleSheet(f"QTextBrowser {{ background: transparent; color: {colours['muted']}; "
                                     f"border-left: 2px solid {colours['border']}; padding-left: 6px; }}")
        self.reasoning.hide()
        lay.addWidget(self.reasoning)
        self.body = AutoHeightBrowser()
        self.body.anchorClicked.connect(self._link)
        lay.addWidget(self.body)

    def set_text(self, text: str, final: bool = True) -> None:
        """final: the whole message (not a streamed answer's text so far, whose tail may be
        the start of a reasoning marker)."""
        self.raw = self.text = text
        if self.role == "user":
            self.body.setPlainText(text)       # what the user typed is shown as typed
            return
        parts = reasoning.split(text, final=final)
        self.text, self.thinking = parts.answer, parts.thinking
        shown = bool(parts.reasoning or parts.thinking)
        self.reasoning_toggle.setVisible(shown)
        if shown:
            words = len(parts.reasoning.split())
            self.reasoning_toggle.setText(("Thinking…" if parts.thinking else "Reasoning")
                                          + (f" ({words} words)" if words else ""))
            if self.reasoning.toPlainText() != parts.reasoning:
                self.reasoning.setPlainText(parts.reasoning)
        html, self.codes = markdown.render(parts.answer, self.md_palette)
        self.body.setHtml(html)
        self.body.setVisible(bool(parts.answer) or not shown)

    def _fold(self, unfolded: bool) -> None:
        self.reasoning_toggle.setArrowType(Qt.ArrowType.DownArrow if unfolded else Qt.ArrowType.RightArrow)
        self.reasoning.setVisible(unfolded)

    def _link(self, url):
        s = url.toString()
        if s.startswith("copy:"):
            i = int(s[5:])
            if i < len(self.codes):
                QGuiApplication.clipboard().setText(self.codes[i])
                self.note.setText("code copied")
                QTimer.singleShot(1500, self.note, lambda: self.note.setText(""))   # cancelled if deleted
        else:
            from PySide6.QtGui import QDesktopServices
            QDesktopServices.openUrl(url)


class ChatView(QScrollArea):
    edit_requested = Signal(int)
    regenerate_requested = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.inner = QWidget()
        self.lay = QVBoxLayout(self.inner)
        self.lay.setContentsMargins(16, 12, 16, 12)
        self.lay.setSpacing(10)
        self.empty = QLabel("Ask anything. Enter sends, Shift+Enter adds a line.")
        self.empty.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.empty.setStyleSheet("color: gray; padding: 40px;")
        self.lay.addWidget(self.empty)
        self.lay.addStretch(1)
        self.setWidget(self.inner)
        self.views: list[MessageView] = []
        self.colours: dict = {}
        self.md_palette = markdown.LIGHT
        self._stick = True
        self.verticalScrollBar().rangeChanged.connect(self._follow)
        self.verticalScrollBar().valueChanged.connect(self._remember)

    def set_look(self, colours: dict, md_palette) -> None:
        self.colours, self.md_palette = colours, md_palette

    def clear(self) -> None:
        for v in self.views:
            v.setParent(None)
            v.deleteLater()
        self.views.clear()
        self.empty.show()

    def add(self, role: str, position: int, text: str) -> MessageView:
        v = MessageView(role, position, self.colours, self.md_palette)
        v.edit_clicked.connect(self.edit_requested)
        v.regenerate_clicked.connect(self.regenerate_requested)
        self.lay.insertWidget(self.lay.count() - 1, v)
        self.views.append(v)
        v.set_text(text)
        self.empty.hide()
        self._stick = True
        self._mark_last()
        return v

    def truncate(self, position: int) -> None:
        """Remove the bubbles at `position` and after."""
        while self.views and self.views[-1].position >= position:
            v = self.views.pop()
            v.setParent(None)
            v.deleteLater()
        self.empty.setVisible(not self.views)
        self._mark_last()

    def set_busy(self, busy: bool) -> None:
        for v in self.views:
            v.buttons["Edit"].setEnabled(not busy)
            v.buttons["Regenerate"].setEnabled(not busy)

    def _mark_last(self) -> None:
        for v in self.views:
            v.buttons["Regenerate"].setVisible(False)
        if self.views and self.views[-1].role == "assistant":
            self.views[-1].buttons["Regenerate"].setVisible(True)

    # keep the newest text in view while it streams, unless the user scrolled up
    def _remember(self, value):
        sb = self.verticalScrollBar()
        self._stick = value >= sb.maximum() - 24

    def _follow(self, _lo, hi):
        if self._stick:
            self.verticalScrollBar().setValue(hi)
