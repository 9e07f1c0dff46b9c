"""Take the README's screenshots: the real window on the real default model,
mid-answer, with the engine panel, in the light and the dark theme.

    xvfb-run -a -s "-screen 0 1280x800x24" python tests/app/screenshots.py docs/
    QT_QPA_PLATFORM=offscreen python tests/app/screenshots.py docs/ server   # docs/screenshot-server.png

(not a test: pytest does not collect it).  The PNGs are palette-quantised with
pngquant when it is installed, to keep them small."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PySide6.QtWidgets import QApplication  # noqa: E402

from app.settings import Settings  # noqa: E402
from app.window import MainWindow  # noqa: E402

QUESTION = "Write a short Python function that checks whether a number is prime, then explain it."


def wait(app, cond, timeout):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        app.processEvents()
        time.sleep(0.01)
    return cond()


def shoot(app, look: str, out: Path) -> None:
    os.environ["LLAMBA_DATA_DIR"] = tempfile.mkdtemp(prefix="llamba-shots-")     # a fresh chat list
    s = Settings(model="smollm2-135m", device="cpu", n_ctx=4096, temperature=0.0, max_tokens=160, theme=look)
    w = MainWindow(settings=s)
    w.resize(1180, 720)
    w.show()
    assert wait(app, lambda: w.model_info is not None or bool(w.last_error), 600), "no model"
    assert w.model_info is not None, w.last_error
    w.store.rename(w.chat_id, "Prime numbers in Python")
    other = w.store.new_chat("Explain the KV cache")
    w.store.add(other, "user", "What is a KV cache?")
    w.store.add(other, "assistant", "It stores each layer's keys and values so earlier tokens are not recomputed.")
    w.store.new_chat("Trip ideas for Lisbon")
    w.open_chat(w.store.chats()[-1].id)
    w.send(QUESTION)
    # mid-answer: the code block and some prose are in, the answer is still streaming
    wait(app, lambda: w.stream_text.count("\n") >= 6 and "```" in w.stream_text, 900)
    wait(app, lambda: False, 0.3)
    assert w.busy, "the answer ended before the screenshot"
    w.grab().save(str(out))
    w.stop()
    wait(app, lambda: not w.busy, 60)
    w.close()
    if shutil.which("pngquant"):
        subprocess.run(["pngquant", "--force", "--skip-if-larger", "--quality=70-95", "--strip",
                        "--output", str(out), str(out)], check=False)
    print(out, out.stat().st_size, "bytes")


def shoot_server(app, out: Path) -> None:
    """The local server on: an OpenAI client's streamed request in flight beside the window's own answer."""
    import threading

    import openai
    os.environ["LLAMBA_DATA_DIR"] = tempfile.mkdtemp(prefix="llamba-shots-")
    s = Settings(model="smollm2-135m", device="cpu", n_ctx=4096, temperature=0.0, max_tokens=160, theme="light",
                 server_port=0)
    w = MainWindow(settings=s)
    w.resize(1180, 800)
    w.show()
    assert wait(app, lambda: w.model_info is not None or bool(w.last_error), 600), "no model"
    assert w.model_info is not None, w.last_error
    w.store.rename(w.chat_id, "Prime numbers in Python")
    w.refresh_chats()
    w.set_server(True)
    assert wait(app, lambda: w.server_state == "on", 30), w.last_error
    client = openai.OpenAI(base_url=w.server_info["url"], api_key=w.server_info["api_key"], max_retries=0, timeout=120)
    let_go = threading.Event()

    def api():
        stream = client.chat.completions.create(model="any", stream=True, max_tokens=300, messages=[
            {"role": "user", "content": "Summarise the plot of Hamlet in three paragraphs."}])
        for _ in stream:
            if let_go.is_set():
                stream.close()
                return
    t = threading.Thread(target=api, daemon=True)
    t.start()
    assert wait(app, lambda: "API · running" in w.panel.server_requests.text(), 60), "no request in flight"
    w.send(QUESTION)
    wait(app, lambda: w.stream_text.count("\n") >= 4 and "this chat" in w.panel.server_requests.text(), 600)
    wait(app, lambda: False, 0.5)
    assert w.busy, "the answer ended before the screenshot"
    w.grab().save(str(out))
    let_go.set()
    w.stop()
    wait(app, lambda: not w.busy, 60)
    w.close()
    t.join(30)
    if shutil.which("pngquant"):
        subprocess.run(["pngquant", "--force", "--skip-if-larger", "--quality=70-95", "--strip",
                        "--output", str(out), str(out)], check=False)
    else:
        try:                        # Pillow's palette, where pngquant is not installed
            from PIL import Image
            Image.open(out).convert("RGB").quantize(256, dither=Image.Dither.NONE).save(out, optimize=True)
        except ImportError:
            pass
    print(out, out.stat().st_size, "bytes")


def main(folder: str = "docs", which: str = "chat") -> int:
    app = QApplication(sys.argv[:1])
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    if which == "server":
        shoot_server(app, out / "screenshot-server.png")
        return 0
    for look in ("light", "dark"):
        shoot(app, look, out / f"screenshot-{look}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
