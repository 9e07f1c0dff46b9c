"""Chatting in a real window on the real default model: streaming, the live
engine panel against the engine's own accounting, stop, regenerate, edit,
event-loop responsiveness."""
from __future__ import annotations

import json
import math
import os
import re
import time

from PySide6.QtCore import Qt

ANSWER_TIMEOUT_MS = 400_000


def _num(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in {text!r}"
    return float(m.group(1))


def test_streamed_answer_live_panel_and_event_loop(make_window, qtbot, stall_probe, capsys):
    # enough tokens to span many 40 ms UI ticks even on a fast machine (24 tokens at
    # ~150 t/s gave 3-4 ticks, and the "grew over several ticks" checks flaked)
    w = make_window(max_tokens=80)
    seen = []        # what the window showed at each UI tick while the answer streamed

    def record():
        if w.busy:
            seen.append((w.stream_view.text, w.panel.kv_label.text(), w.panel.gen_label.text(),
                         w.panel.ctx_label.text()))
    w.flush_timer.timeout.connect(record)
    load_before = os.getloadavg()[0]
    stall_probe.start()
    qtbot.keyClicks(w.composer, "Write a Python function that adds two numbers.")
    with qtbot.waitSignal(w.worker.finished, timeout=ANSWER_TIMEOUT_MS):
        qtbot.keyClick(w.composer, Qt.Key.Key_Return)       # Enter sends
    qtbot.waitUntil(lambda: not w.busy, timeout=10_000)   # the window's finished slot ran too
    stall_probe.stop()
    qtbot.wait(100)

    # streamed: the answer grew over several ticks, each a prefix of the final text
    final = w.messages[-1]
    assert final.role == "assistant" and final.complete and final.content
    texts = [s[0] for s in seen if s[0]]
    assert len(set(texts)) >= 3, texts
    assert all(final.content.startswith(t) for t in texts)
    assert w.view.views[-1].text == final.content
    assert w.store.messages(w.chat_id)[-1].content == final.content

    # the panel's numbers moved during generation...
    assert len({s[2] for s in seen}) >= 3 and len({s[3] for s in seen}) >= 3

    # ...and at the end they agree with the engine's own accounting
    eng = w.worker.engine
    kv = eng.stats()
    seq = w.worker.session.seq
    gen_stats = w.worker.session.last_stats
    ctx = int(_num(r"^(\d+) / ", w.panel.ctx_label.text()))
    assert ctx == len(seq) == kv["tokens_per_sequence"][seq.seq_id]
    assert int(_num(r"/ (\d+) tokens", w.panel.ctx_label.text())) == eng.n_ctx
    blocks = int(_num(r"(\d+) of \d+ blocks", w.panel.kv_label.text()))
    assert blocks == kv["blocks_used"] >= math.ceil(len(seq) / kv["block_size"])
    assert int(_num(r"of (\d+) blocks", w.panel.kv_label.text())) == kv["blocks_total"]
    mib = _num(r"^([\d.]+) (?:MiB|KiB)", w.panel.kv_label.text())
    unit = 2**20 if "MiB" in w.panel.kv_label.text().split("·")[0] else 2**10
    assert abs(mib * unit - kv["bytes_used"]) <= 0.05 * unit + 1
    assert int(_num(r"^(\d+) tokens", w.panel.gen_label.text())) == gen_stats.generated_tokens
    tps = _num(r"([\d.]+) t/s", w.panel.gen_label.text())
    assert tps == round(gen_stats.tokens_per_s, 1) and 0 < tps < 5000
    # tokens/s against wall time: generated tokens over the decode time the loop measured
    assert abs(tps - (gen_stats.generated_tokens - 1) / gen_stats.generate_seconds) < 0.1
    assert _num(r"([\d.]+) t/s", w.panel.prompt_label.text()) > 0
    assert len(w.panel.sparkline.values) >= 2

    gaps = sorted(stall_probe.gaps)
    p99 = gaps[int(0.99 * (len(gaps) - 1))] - stall_probe.period
    with capsys.disabled():
        print(f"\n[app] event loop while generating {gen_stats.generated_tokens} tokens at "
              f"{gen_stats.tokens_per_s:.1f} t/s: longest stall {1000 * stall_probe.max_stall:.1f} ms, "
              f"p99 {1000 * p99:.1f} ms over {len(gaps)} probe ticks (load average {load_before:.1f} "
              f"on {os.cpu_count()} cores)")
    assert p99 < 0.050
    if load_before <= 1.5 * os.cpu_count():
        assert stall_probe.max_stall < 0.050
    # else other processes hold the CPUs: the longest gap then measures the OS
    # scheduler, not this window; the p99 above still holds the app to 50 ms


def test_shift_enter_adds_a_line_and_enter_sends(make_window, qtbot):
    w = make_window()
    qtbot.keyClicks(w.composer, "first line")
    qtbot.keyClick(w.composer, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(w.composer, "second line")
    assert w.composer.toPlainText() == "first line\nsecond line"
    assert not w.messages
    with qtbot.waitSignal(w.worker.finished, timeout=ANSWER_TIMEOUT_MS):
        qtbot.keyClick(w.composer, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: not w.busy, timeout=10_000)   # the window's finished slot ran too
    assert [m.role for m in w.messages] == ["user", "assistant"]
    assert w.messages[0].content == "first line\nsecond line"
    assert w.composer.toPlainText() == ""


def test_stop_halts_decoding(make_window, qtbot, capsys):
    w = make_window(max_tokens=400)
    got = []
    w.worker.piece.connect(lambda rid, t: got.append(time.perf_counter()))
    w.send("Count from 1 to 300, separated by commas.")
    qtbot.waitUntil(lambda: len(got) >= 4, timeout=ANSWER_TIMEOUT_MS)
    done = []
    w.worker.finished.connect(lambda rid, final: done.append((time.perf_counter(), json.loads(final))))
    t_stop = time.perf_counter()
    qtbot.mouseClick(w.stop_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: bool(done), timeout=30_000)
    t_done, final = done[0]
    latency = t_done - t_stop
    # the engine stopped decoding (not just the display): the token loop ended on the
    # stop request, long before max_tokens
    assert final["stop_reason"] == "cancelled"
    assert final["generated_tokens"] < 400
    assert not [t for t in got if t > t_done]
    qtbot.wait(50)
    assert not w.busy and w.send_button.isEnabled()
    assert w.messages[-1].complete and w.view.views[-1].note.text() == "stopped"
    # The loop checks the stop flag after every token, so the delay is at most the
    # one decode step in flight: under 100 ms whenever a step is shorter than 50 ms.
    step = 1 / min(final["rate_history"]) if final["rate_history"] else 0.0
    with capsys.disabled():
        print(f"\n[app] stop latency {1000 * latency:.1f} ms (longest decode step {1000 * step:.1f} ms)")
    assert latency < 0.100 or latency < step + 0.050


def test_regenerate_then_edit(make_window, qtbot):
    w = make_window()
    question = "Name three colours of the rainbow, please. Answer in one short line."
    with qtbot.waitSignal(w.worker.finished, timeout=ANSWER_TIMEOUT_MS):
        w.send(question)
    qtbot.waitUntil(lambda: not w.busy, timeout=10_000)   # the window's finished slot ran too
    first = w.messages[-1].content
    assert first

    with qtbot.waitSignal(w.worker.finished, timeout=ANSWER_TIMEOUT_MS):
        w.view.views[-1].buttons["Regenerate"].click()
    qtbot.waitUntil(lambda: not w.busy, timeout=10_000)   # the window's finished slot ran too
    rows = w.store.messages(w.chat_id)
    assert [m.role for m in rows] == ["user", "assistant"]     # the old answer was replaced
    assert rows[1].content and rows[1].complete
    assert w.worker.session.messages == [{"role": "user", "content": question},
                                         {"role": "assistant", "content": rows[1].content}]
    # the same prompt again: its full blocks came from the prefix cache
    reused = int(_num(r"^(\d+) tokens", w.panel.reused_label.text()))
    assert reused > 0 and reused == w.worker.session.last_stats.reused_tokens

    w.view.views[0].buttons["Edit"].click()
    assert w.editing == 0 and w.composer.toPlainText() == question
    w.composer.setPlainText("Name three animals that live in the sea.")
    with qtbot.waitSignal(w.worker.finished, timeout=ANSWER_TIMEOUT_MS):
        qtbot.keyClick(w.composer, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: not w.busy, timeout=10_000)   # the window's finished slot ran too
    rows = w.store.messages(w.chat_id)
    assert [m.role for m in rows] == ["user", "assistant"]
    assert rows[0].content == "Name three animals that live in the sea."
    assert rows[1].content and rows[1].complete
    # the engine answered the edited conversation, not the old one
    assert w.worker.session.messages[0]["content"] == rows[0].content
    assert [v.text for v in w.view.views] == [r.content for r in rows]

    w.clear_chat()
    assert w.store.messages(w.chat_id) == [] and w.view.views == []
