"""Failures show a message in the window; they never crash or close it."""
from __future__ import annotations

ANSWER_TIMEOUT_MS = 400_000
LOAD_TIMEOUT_MS = 900_000       # as conftest's: a cold cache's first load compiles the kernels


def test_bad_model_path_shows_an_error_dialog(make_window, qtbot, tmp_path):
    w = make_window(wait=False, model=str(tmp_path / "no-such-model.gguf"))
    qtbot.waitUntil(lambda: w.error_box is not None, timeout=LOAD_TIMEOUT_MS)
    assert w.error_box.isVisible()
    assert "model not found" in w.error_box.text() and "no-such-model.gguf" in w.error_box.text()
    assert w.isVisible() and w.model_info is None
    assert not w.send_button.isEnabled() and not w.send("hello")
    w.error_box.accept()

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a model" * 100)
    w.load_model(str(junk))
    qtbot.waitUntil(lambda: w.error_box is not None, timeout=LOAD_TIMEOUT_MS)
    assert "junk.gguf" in w.error_box.text() or "GGUF" in w.error_box.text()
    assert w.isVisible()
    w.error_box.accept()


def test_recovers_by_loading_a_good_model_after_a_bad_one(make_window, qtbot, tmp_path, smollm):
    w = make_window(wait=False, model=str(tmp_path / "missing.gguf"))
    qtbot.waitUntil(lambda: w.error_box is not None, timeout=LOAD_TIMEOUT_MS)
    w.error_box.accept()
    w.load_model(str(smollm))
    qtbot.waitUntil(lambda: w.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    assert w.send_button.isEnabled()
    assert str(smollm) in w.settings.recent_models


def test_context_overflow_is_a_message_not_a_crash(make_window, qtbot):
    w = make_window(overflow="stop")
    long_text = "word " * 5000                       # far more than the 2048-token context
    with qtbot.waitSignal(w.worker.failed, timeout=ANSWER_TIMEOUT_MS):
        w.send(long_text)
    qtbot.waitUntil(lambda: w.error_box is not None, timeout=5000)
    assert "Context overflow" in w.error_box.text() and "2048" in w.error_box.text()
    w.error_box.accept()
    # the empty answer is gone; the question stays, and the app still answers
    assert [m.role for m in w.store.messages(w.chat_id)] == ["user"]
    assert not w.busy and w.isVisible()
    w.clear_chat()
    with qtbot.waitSignal(w.worker.finished, timeout=ANSWER_TIMEOUT_MS):
        w.send("Hi!")
    qtbot.waitUntil(lambda: not w.busy, timeout=10_000)   # the window's finished slot ran too
    assert w.messages[-1].content
