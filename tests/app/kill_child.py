"""Run by test_persistence: the app streaming a long answer, printing what the
window shows at every UI tick, until the test SIGKILLs it."""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QTimer  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from app.settings import Settings  # noqa: E402
from app.window import MainWindow  # noqa: E402


def main(model: str) -> int:
    app = QApplication([])
    w = MainWindow(settings=Settings(model=model, device="cpu", n_ctx=2048, temperature=0.0, max_tokens=400))
    w.show()

    def shown():
        if w.stream_view is not None and w.stream_view.text:
            print(json.dumps({"shown": w.stream_view.text, "message_id": w.stream_msg.id}), flush=True)

    def poll():
        # (a timer on the UI thread: a plain function connected to the worker's
        # signals would run in the worker's thread)
        if w.last_error:
            print(json.dumps({"error": w.last_error}), flush=True)
            app.exit(2)
        elif w.model_info is not None:
            timer.stop()
            w.flush_timer.timeout.connect(shown)      # after the window's own flush: shows what it just showed
            w.send("Count from 1 to 300, separated by commas.")

    timer = QTimer()
    timer.timeout.connect(poll)
    timer.start(50)
    return app.exec()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
