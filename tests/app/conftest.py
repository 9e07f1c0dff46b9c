"""App tests: a real window (offscreen) on the real default model.

The engine is loaded once per test session: windows with the same model
settings share it through the worker's engine cache, as reopened windows do in
the app."""
from __future__ import annotations

import os
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import QTimer  # noqa: E402

# A cold Numba cache compiles the kernels on the first load: SmolLM2 on a 2-core AVX2-only
# EPYC 6 min 42 s with the u8 x s8 kernels (1 min 19 s with the int16 ones; quant/NOTES.md,
# session 38), so 15 minutes leaves a slower CI machine twice that.
LOAD_TIMEOUT_MS = 900_000


@pytest.fixture(scope="session")
def smollm(model_path):
    return model_path("smollm2-135m")


@pytest.fixture
def make_window(qtbot, tmp_path, monkeypatch, smollm):
    """make_window(**settings) -> a shown MainWindow with its model loaded, its
    chats and settings in this test's temp dir."""
    monkeypatch.setenv("LLAMBA_DATA_DIR", str(tmp_path))
    from app.settings import Settings
    from app.window import MainWindow

    def make(wait: bool = True, load: bool = True, **overrides):
        fields = dict(model=str(smollm), device="cpu", n_ctx=2048, temperature=0.0, max_tokens=16,
                      theme="light", default_system="You are a helpful assistant.")
        fields.update(overrides)
        w = MainWindow(settings=Settings(**fields), autoload=load)
        qtbot.addWidget(w)
        w.show()
        if wait and load:
            qtbot.waitUntil(lambda: w.model_info is not None or bool(w.last_error), timeout=LOAD_TIMEOUT_MS)
            assert w.model_info is not None, w.last_error
        return w
    return make


class StallProbe:
    """A 5 ms QTimer on the UI thread: the longest gap between its ticks is the
    longest time the event loop could not run (plus the 5 ms period)."""

    def __init__(self, period_ms: int = 5):
        self.period = period_ms / 1000
        self.timer = QTimer()
        self.timer.setInterval(period_ms)
        self.timer.timeout.connect(self._tick)
        self.last = None
        self.gaps: list[float] = []

    def _tick(self):
        now = time.perf_counter()
        if self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now

    def start(self):
        self.last = None
        self.gaps.clear()
        self.timer.start()

    def stop(self):
        self.timer.stop()

    @property
    def max_stall(self) -> float:
        """Longest tick gap beyond the timer's own period, in seconds."""
        return max(self.gaps) - self.period if self.gaps else 0.0


@pytest.fixture
def stall_probe():
    p = StallProbe()
    yield p
    p.stop()
