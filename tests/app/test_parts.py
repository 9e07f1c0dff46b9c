"""The window's parts on their own: Markdown rendering, the chat store,
settings, the About box, shortcuts."""
from __future__ import annotations

import sqlite3

from PySide6.QtGui import QGuiApplication

from app import __version__
from app.markdown import render
from app.settings import Settings, load_settings, save_settings
from app.store import ChatStore


def test_markdown_code_blocks_are_monospace_with_a_copy_link():
    html, codes = render("Here:\n\n```python\nprint(1 < 2)\n```\n\nand `x` **bold** *it*\n\n- a\n- b")
    assert codes == ["print(1 < 2)"]
    assert "<pre" in html and "monospace" in html and 'href="copy:0"' in html
    assert "print(1 &lt; 2)" in html
    assert "<b>bold</b>" in html and "<i>it</i>" in html and "<ul><li>a</li><li>b</li></ul>" in html


def test_markdown_accepts_a_half_streamed_document():
    html, codes = render("Sure:\n```js\nconsole.log(")        # the fence is still open
    assert codes == ["console.log("] and "<pre" in html
    html, _ = render("a **half bold")
    assert "**half bold" in html and "<b>" not in html
    assert render("<script>x</script>")[0] == "<p>&lt;script&gt;x&lt;/script&gt;</p>"


def test_copy_button_puts_the_code_on_the_clipboard(qtbot):
    from app.chat_view import MessageView
    from app.theme import BUBBLE
    from app.markdown import LIGHT
    from PySide6.QtCore import QUrl
    v = MessageView("assistant", 1, BUBBLE["light"], LIGHT)
    qtbot.addWidget(v)
    v.set_text("Two blocks:\n```\nfirst\n```\n```sh\necho second\n```")
    v._link(QUrl("copy:1"))
    assert QGuiApplication.clipboard().text() == "echo second"


def test_reasoning_is_shown_apart_and_folded(qtbot):
    """A model's reasoning (gpt-oss's analysis channel, Qwen3's think tags) sits in its own
    folded block above the answer; Copy copies the answer; while the reasoning streams the
    bubble says so."""
    from app.chat_view import MessageView
    from app.markdown import LIGHT
    from app.theme import BUBBLE
    v = MessageView("assistant", 1, BUBBLE["light"], LIGHT)
    qtbot.addWidget(v)
    v.show()
    v.set_text("<|channel|>analysis<|message|>The user wants a greeting.")
    assert v.thinking and v.reasoning_toggle.isVisible() and v.reasoning_toggle.text().startswith("Thinking")
    assert not v.reasoning.isVisible() and not v.body.isVisible()
    v.set_text("<|channel|>analysis<|message|>The user wants a greeting.<|end|><|start|>assistant"
               "<|channel|>final<|message|>Hello **there**.")
    assert not v.thinking and v.reasoning_toggle.text() == "Reasoning (5 words)"
    assert v.text == "Hello **there**." and v.body.toPlainText() == "Hello there." and v.body.isVisible()
    assert not v.reasoning.isVisible()
    v.reasoning_toggle.click()
    assert v.reasoning.isVisible() and v.reasoning.toPlainText() == "The user wants a greeting."
    v.buttons["Copy"].click()
    assert QGuiApplication.clipboard().text() == "Hello **there**."
    w = MessageView("assistant", 2, BUBBLE["light"], LIGHT)
    qtbot.addWidget(w)
    w.show()
    w.set_text("<think>\nshort\n</think>\n\nYes.")
    assert w.text == "Yes." and w.reasoning_toggle.text() == "Reasoning (1 words)" and not w.reasoning.isVisible()
    w.set_text("Plain answer.")
    assert not w.reasoning_toggle.isVisible() and w.text == "Plain answer."


def test_store_is_wal_and_commits_each_message(tmp_path):
    s = ChatStore(tmp_path / "c.db")
    cid = s.new_chat("t", system="be nice")
    m = s.add(cid, "user", "hi")
    a = s.add(cid, "assistant", "", complete=False)
    s.update(a.id, "hel")
    # another connection sees it at once: nothing waits in an open transaction
    other = sqlite3.connect(tmp_path / "c.db")
    assert other.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert other.execute("SELECT content, complete FROM messages WHERE id=?", (a.id,)).fetchone() == ("hel", 0)
    s.update(a.id, "hello", complete=True, stats={"tokens_per_s": 3.5})
    assert [(x.role, x.content, x.complete) for x in s.messages(cid)] == [("user", "hi", True),
                                                                          ("assistant", "hello", True)]
    assert s.messages(cid)[1].stats == {"tokens_per_s": 3.5}
    s.truncate(cid, m.position + 1)
    assert len(s.messages(cid)) == 1
    s.delete(cid)
    assert s.chats() == [] and other.execute("SELECT COUNT(*) FROM messages").fetchone() == (0,)


def test_settings_persist(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMBA_DATA_DIR", str(tmp_path))
    s = Settings(model="/x/y.gguf", temperature=0.3, top_k=7, device="cpu", overflow="stop",
                 show_engine_panel=False, cpu_moe=-1)
    s.add_recent("/x/y.gguf")
    s.add_recent("smollm2-135m")
    save_settings(s)
    back = load_settings()
    assert back == s
    assert back.recent_models == ["smollm2-135m", "/x/y.gguf"]


def test_settings_dialog_keeps_the_experts_on_the_cpu_setting(qtbot):
    """The engine settings' "Experts on the CPU" (--cpu-moe: all, --n-cpu-moe N): shown,
    returned, and a change of it reloads the model."""
    from app.settings_dialog import SettingsDialog
    d = SettingsDialog(Settings(cpu_moe=-1))
    qtbot.addWidget(d)
    assert d.cpu_moe.text() == "all" and d.result_settings().cpu_moe == -1
    d.cpu_moe.setValue(3)
    assert d.result_settings().cpu_moe == 3
    assert Settings(cpu_moe=3).engine_key() != Settings().engine_key()


def test_about_shows_the_package_version_and_shortcuts_exist(make_window):
    import tomllib
    from pathlib import Path
    w = make_window(load=False)
    with open(Path(__file__).resolve().parents[2] / "pyproject.toml", "rb") as f:
        assert __version__ == tomllib.load(f)["project"]["version"]
    assert f"Llamba {__version__}" in w.about_text()
    shortcuts = {a.shortcut().toString() for a in w.findChildren(type(w.stop_action)) if not a.shortcut().isEmpty()}
    assert {"Ctrl+N", "Ctrl+O", "Ctrl+R", "Esc", "Ctrl+L", "Ctrl+E", "Ctrl+,", "F1"} <= shortcuts


def test_download_progress_dialog_follows_the_worker(make_window, qtbot):
    """The worker's catalog-download progress drives a dialog (no network here:
    the signal is emitted as runtime.download's callback would)."""
    w = make_window(load=False)
    w.loading = True
    w.worker.download_progress.emit(25e6, 100e6, "smollm2-135m")
    qtbot.waitUntil(lambda: w._download is not None and w._download.isVisible(), timeout=5000)
    assert w._download.value() == 250 and "smollm2-135m" in w._download.labelText()
    w.worker.download_progress.emit(100e6, 100e6, "smollm2-135m")
    qtbot.waitUntil(lambda: w._download.value() == 1000, timeout=5000)
    w.worker.status.emit("Compiling kernels (first run only)…")
    qtbot.waitUntil(lambda: "Compiling kernels" in w.banner_label.text(), timeout=5000)
    assert w.banner.isVisible()
    w._on_load_failed("stopped for the test")
    assert w._download is None and not w.banner.isVisible()
    w.error_box.accept()
