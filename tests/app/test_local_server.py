"""The local server: the window serves its loaded model on 127.0.0.1 to OpenAI clients
(the official `openai` package) while its own chat keeps answering through the same
scheduler, shows the URL, the API key and the requests in flight, and hands the engine
back to its chat when switched off."""
from __future__ import annotations

import json
import re
import threading

import httpx
import pytest
from PySide6.QtCore import QTimer
from PySide6.QtGui import QGuiApplication

openai = pytest.importorskip("openai")

START_MS = 30_000
ANSWER_MS = 300_000
CLIENT_S = 120.0


def _panel_rows(w) -> str:
    return w.panel.server_requests.text()


def test_server_switch_openai_client_in_flight_chat_beside_and_off(make_window, qtbot, capsys):
    w = make_window(server_port=0, max_tokens=24)
    assert w.server_state == "off" and not w.panel.server_switch.isChecked()
    assert not w.copy_key_action.isEnabled()

    # switch on (the panel's switch): the URL and the key are shown
    w.panel.server_switch.click()
    qtbot.waitUntil(lambda: w.server_state == "on" or bool(w.last_error), timeout=START_MS)
    assert w.server_state == "on", w.last_error
    url, key = w.panel.server_url.text(), w.panel.server_key.text()
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", url), url
    assert key.startswith("sk-llamba-") and len(key) > 30
    assert w.server_action.isChecked() and w.panel.server_switch.isChecked() and w.copy_key_action.isEnabled()
    w.panel.copy_key_button.click()
    assert QGuiApplication.clipboard().text() == key
    qtbot.waitUntil(lambda: "0 running · 0 waiting" in w.panel.server_load.text(), timeout=5_000)

    client = openai.OpenAI(base_url=url, api_key=key, timeout=CLIENT_S, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="sk-wrong", timeout=10, max_retries=0).models.list()

    # a chat completion through the official client (its own thread: the window keeps running)
    done = {}

    def whole():
        try:
            done["models"] = [m.id for m in client.models.list().data]
            done["resp"] = client.chat.completions.create(
                model=done["models"][0], messages=[{"role": "user", "content": "Say hello in one short sentence."}],
                max_tokens=12, temperature=0)
        except BaseException as e:
            done["error"] = e
    t = threading.Thread(target=whole, daemon=True)
    t.start()
    qtbot.waitUntil(lambda: not t.is_alive(), timeout=ANSWER_MS)
    assert "error" not in done, done.get("error")
    resp = done["resp"]
    assert done["models"] == [w.model_info["name"]]
    assert resp.object == "chat.completion" and resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content and 1 <= resp.usage.completion_tokens <= 12
    qtbot.waitUntil(lambda: "1 done" in w.panel.server_load.text(), timeout=5_000)

    # a streamed request held in flight (a regex it cannot complete before max_tokens): the panel shows
    # it running; the window's own chat answers beside it; closing the stream cancels it
    stream_state = {"text": "", "chunks": 0, "finish": None}
    first, let_go = threading.Event(), threading.Event()

    def streamed():
        try:
            stream = client.chat.completions.create(
                model="any", messages=[{"role": "user", "content": "Count from 1 to 500, separated by commas."}],
                max_tokens=400, temperature=0, stream=True, extra_body={"regex": r"(\d+, ){1000}"})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    stream_state["text"] += chunk.choices[0].delta.content
                    stream_state["chunks"] += 1
                    first.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    stream_state["finish"] = chunk.choices[0].finish_reason
                if let_go.is_set():
                    stream.close()          # the client goes away mid-answer
                    break
        except BaseException as e:
            stream_state["error"] = e
        finally:
            first.set()
    t = threading.Thread(target=streamed, daemon=True)
    t.start()
    qtbot.waitUntil(first.is_set, timeout=ANSWER_MS)
    assert "error" not in stream_state, stream_state.get("error")
    api_row = r"#\d+ API · running · \d+( \(\d+ cached\))? \+ \d+/400 tokens"
    qtbot.waitUntil(lambda: re.search(api_row, _panel_rows(w)) is not None, timeout=5_000)
    assert re.match(r"[12] running", w.panel.server_load.text()), w.panel.server_load.text()

    # the worker's snapshots, polled faster than the panel shows them
    seen = []
    poll = QTimer()
    poll.setInterval(5)
    poll.timeout.connect(lambda: seen.append(w.worker.server_snapshot))
    poll.start()
    with qtbot.waitSignal(w.worker.finished, timeout=ANSWER_MS) as sig:
        assert w.send("What is the capital of France?")
    qtbot.waitUntil(lambda: not w.busy, timeout=10_000)
    final = json.loads(sig.args[1])
    answer = w.messages[-1]
    assert answer.role == "assistant" and answer.complete and answer.content
    assert w.view.views[-1].text == answer.content
    assert final["generated_tokens"] >= 1 and final["stop_reason"] in ("eos", "length")
    assert w.worker.session.seq is None        # the turn went through the scheduler, not the ChatSession
    assert t.is_alive() and stream_state["finish"] is None      # the API request was in flight throughout
    poll.stop()
    # the chat's request ran on the scheduler beside the client's
    both = [x for x in seen if x and x["running"] == 2
            and sorted(r["source"] for r in x["requests"] if r["state"] == "running") == ["API", "chat"]]
    assert both, seen[-5:]

    let_go.set()
    t.join(CLIENT_S)
    assert not t.is_alive() and "error" not in stream_state, stream_state.get("error")
    assert re.fullmatch(r"(\d+, )*\d*,? ?", stream_state["text"]), stream_state["text"][:200]
    qtbot.waitUntil(lambda: w.panel.server_load.text().startswith("0 running · 0 waiting"), timeout=30_000)

    # the Stop button cancels the window's request on the scheduler
    w.settings.max_tokens = 300
    pieces = []
    w.worker.piece.connect(lambda rid, text: pieces.append(text))
    with qtbot.waitSignal(w.worker.finished, timeout=ANSWER_MS) as sig:
        assert w.send("Count from 1 to 300, separated by commas.")
        qtbot.waitUntil(lambda: len(pieces) >= 3, timeout=ANSWER_MS)
        w.stop()
    qtbot.waitUntil(lambda: not w.busy, timeout=10_000)
    stopped = json.loads(sig.args[1])
    assert stopped["stop_reason"] == "cancelled" and stopped["generated_tokens"] < 300
    assert w.view.views[-1].note.text() == "stopped"
    w.settings.max_tokens = 24

    # switch off (the menu's action): the port no longer answers, the chat answers as before
    w.server_action.trigger()
    qtbot.waitUntil(lambda: w.server_state == "off", timeout=START_MS)
    assert not w.panel.server_switch.isChecked() and not w.server_action.isChecked()
    assert w.panel.server_key.text() == "" and w.panel.server_url.text() == "off"
    assert w.worker.server is None
    with pytest.raises(httpx.TransportError):
        httpx.get(url.removesuffix("/v1") + "/health", timeout=5)
    with qtbot.waitSignal(w.worker.finished, timeout=ANSWER_MS) as sig:
        assert w.send("And the capital of Italy?")
    qtbot.waitUntil(lambda: not w.busy, timeout=10_000)
    assert w.messages[-1].complete and w.messages[-1].content
    assert w.worker.session.seq is not None                    # the ChatSession drives the engine again
    assert w.worker.session.messages[-1] == {"role": "assistant", "content": w.messages[-1].content}
    with capsys.disabled():
        print(f"\n[app] local server: {url}; the streamed request got {stream_state['chunks']} chunks before "
              f"its client went away")


def test_server_needs_a_model_and_its_port_is_a_setting(make_window, qtbot, tmp_path):
    w = make_window(load=False, server_port=0)
    w.set_server(True)
    assert w.server_state == "off" and not w.server_action.isChecked() and not w.panel.server_switch.isChecked()
    assert "Load a model first" in w.status_label.text()

    from app.settings import Settings, load_settings, save_settings
    from app.settings_dialog import SettingsDialog
    assert Settings().server_port == 8080
    dlg = SettingsDialog(Settings(server_port=8123))
    qtbot.addWidget(dlg)
    assert dlg.server_port.value() == 8123
    dlg.server_port.setValue(9001)
    save_settings(dlg.result_settings())
    assert load_settings().server_port == 9001
