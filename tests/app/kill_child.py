"""Run by test_persistence: the app streaming a long answer, printing what the
window shows at every UI tick, until the test SIGKILLs it."""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

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

    def ready(_info):
        w.flush_timer.timeout.connect(shown)      # after the window's own flush: shows what it just showed
        w.send("Count from 1 to 300, separated by commas.")

    w.worker.loaded.connect(ready)
    w.worker.load_failed.connect(lambda msg: (print(json.dumps({"error": msg}), flush=True), app.exit(2)))
    return app.exec()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
