"""The Settings dialog: model, device, draft model, sampling, context, look, the local server's port."""
from __future__ import annotations

import json
from dataclasses import replace

from PySide6.QtWidgets import (QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFileDialog, QFormLayout,
                               QGroupBox, QHBoxLayout, QLineEdit, QMessageBox, QPlainTextEdit, QPushButton, QSpinBox,
                               QVBoxLayout, QWidget)

from models.catalog import CATALOG

from .settings import DEVICES, OVERFLOW_POLICIES, THEMES, Settings


def _combo(items: dict, current: str) -> QComboBox:
    c = QComboBox()
    for key, label in items.items():
        c.addItem(label, key)
    i = c.findData(current)
    c.setCurrentIndex(max(i, 0))
    return c


class ModelPicker(QWidget):
    """An editable list of catalog names and recent files, plus a Browse button."""

    def __init__(self, current: str, recent: list, allow_empty=False):
        super().__init__()
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        self.combo = QComboBox()
        self.combo.setEditable(True)
        if allow_empty:
            self.combo.addItem("")
        for name in list(CATALOG) + [r for r in recent if r not in CATALOG]:
            self.combo.addItem(name)
        self.combo.setCurrentText(current)
        self.combo.setMinimumWidth(280)
        lay.addWidget(self.combo, 1)
        b = QPushButton("Browse…")
        b.clicked.connect(self._browse)
        lay.addWidget(b)

    def _browse(self):
        path, _ = QFileDialog.getOpenFileName(self, "Choose a model", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.combo.setCurrentText(path)

    def value(self) -> str:
        return self.combo.currentText().strip()


class SettingsDialog(QDialog):
    def __init__(self, s: Settings, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self.s = s
        lay = QVBoxLayout(self)

        model = QGroupBox("Model")
        f = QFormLayout(model)
        self.model = ModelPicker(s.model, s.recent_models)
        f.addRow("Model file", self.model)
        self.device = _combo(DEVICES, s.device)
        f.addRow("Device", self.device)
        self.gpu_layers = QSpinBox()
        self.gpu_layers.setRange(-1, 1000)
        self.gpu_layers.setSpecialValueText("all")
        self.gpu_layers.setValue(s.gpu_layers)
        f.addRow("GPU layers", self.gpu_layers)
        self.cpu_moe = QSpinBox()       # llama.cpp's --cpu-moe (all) / --n-cpu-moe N
        self.cpu_moe.setRange(-1, 1000)
        self.cpu_moe.setSpecialValueText("all")
        self.cpu_moe.setValue(s.cpu_moe)
        self.cpu_moe.setToolTip("Mixture-of-experts models on a GPU: keep the experts of the first N layers "
                                "(all: every layer) in system memory and run them on the CPU, so a large model "
                                "fits a small card. 0: none.")
        f.addRow("Experts on the CPU (layers)", self.cpu_moe)
        self.draft = ModelPicker(s.draft_model, s.recent_models, allow_empty=True)
        f.addRow("Draft model", self.draft)
        self.n_ctx = QSpinBox()
        self.n_ctx.setRange(256, 131072)
        self.n_ctx.setSingleStep(256)
        self.n_ctx.setValue(s.n_ctx)
        f.addRow("Context length", self.n_ctx)
        self.overflow = _combo(OVERFLOW_POLICIES, s.overflow)
        f.addRow("When the context is full", self.overflow)
        lay.addWidget(model)

        samp = QGroupBox("Sampling")
        g = QFormLayout(samp)

        def dspin(value, lo, hi, step, decimals=2):
            w = QDoubleSpinBox()
            w.setRange(lo, hi)
            w.setSingleStep(step)
            w.setDecimals(decimals)
            w.setValue(value)
            return w

        self.temperature = dspin(s.temperature, 0.0, 2.0, 0.05)
        g.addRow("Temperature (0 = greedy)", self.temperature)
        self.top_p = dspin(s.top_p, 0.0, 1.0, 0.01)
        g.addRow("Top-p", self.top_p)
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 1000)
        self.top_k.setValue(s.top_k)
        g.addRow("Top-k (0 = off)", self.top_k)
        self.min_p = dspin(s.min_p, 0.0, 1.0, 0.01)
        g.addRow("Min-p", self.min_p)
        self.repeat_penalty = dspin(s.repeat_penalty, 0.5, 2.0, 0.05)
        g.addRow("Repetition penalty", self.repeat_penalty)
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 65536)
        self.max_tokens.setValue(s.max_tokens)
        g.addRow("Max tokens per answer", self.max_tokens)
        self.json_schema = QPlainTextEdit(s.json_schema)
        self.json_schema.setPlaceholderText('empty: free text; e.g. {"type": "object", "properties": ...}')
        self.json_schema.setMaximumHeight(90)
        g.addRow("Answer JSON schema", self.json_schema)
        lay.addWidget(samp)

        look = QGroupBox("Chat and look")
        h = QFormLayout(look)
        self.default_system = QLineEdit(s.default_system)
        h.addRow("System prompt for new chats", self.default_system)
        self.theme = _combo(THEMES, s.theme)
        h.addRow("Theme", self.theme)
        lay.addWidget(look)

        server = QGroupBox("Local server")
        k = QFormLayout(server)
        self.server_port = QSpinBox()
        self.server_port.setRange(0, 65535)
        self.server_port.setSpecialValueText("any free port")
        self.server_port.setValue(s.server_port)
        self.server_port.setToolTip("Server ▸ Local server serves the loaded model to other programs "
                                    "on 127.0.0.1 at this port (OpenAI-compatible, with an API key)")
        k.addRow("Port on 127.0.0.1", self.server_port)
        lay.addWidget(server)

        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        lay.addWidget(buttons)

    def accept(self) -> None:
        text = self.json_schema.toPlainText().strip()
        if text:
            try:
                if not isinstance(json.loads(text), dict):
                    raise ValueError("a JSON schema is an object: {...}")
            except ValueError as e:
                QMessageBox.warning(self, "Answer JSON schema", f"The JSON schema is not valid JSON: {e}")
                return
        super().accept()

    def result_settings(self) -> Settings:
        return replace(
            self.s, model=self.model.value() or self.s.model, device=self.device.currentData(),
            gpu_layers=self.gpu_layers.value(), cpu_moe=self.cpu_moe.value(), draft_model=self.draft.value(),
            n_ctx=self.n_ctx.value(),
            overflow=self.overflow.currentData(), temperature=self.temperature.value(), top_p=self.top_p.value(),
            top_k=self.top_k.value(), min_p=self.min_p.value(), repeat_penalty=self.repeat_penalty.value(),
            max_tokens=self.max_tokens.value(), default_system=self.default_system.text(),
            json_schema=self.json_schema.toPlainText().strip(),
            theme=self.theme.currentData(), recent_models=list(self.s.recent_models),
            server_port=self.server_port.value())
