"""Chats live in SQLite: they survive a restart of the window, and a SIGKILL
mid-answer leaves a readable database holding everything that was shown."""
from __future__ import annotations

import json
import os
import select
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

ANSWER_TIMEOUT_MS = 400_000
ROOT = Path(__file__).resolve().parents[2]


def test_history_survives_a_restart(make_window, qtbot):
    w = make_window(max_tokens=8)
    w.system_edit.setText("You answer briefly.")
    w.system_edit.editingFinished.emit()
    with qtbot.waitSignal(w.worker.finished, timeout=ANSWER_TIMEOUT_MS):
        w.send("What is the capital of France?")
    qtbot.waitUntil(lambda: not w.busy, timeout=10_000)   # the window's finished slot ran too
    w.new_chat()
    with qtbot.waitSignal(w.worker.finished, timeout=ANSWER_TIMEOUT_MS):
        w.send("Say hello.")
    qtbot.waitUntil(lambda: not w.busy, timeout=10_000)   # the window's finished slot ran too
    before = {c.id: (c.title, [(m.role, m.content) for m in w.store.messages(c.id)]) for c in w.store.chats()}
    engine = w.worker.engine
    assert engine.stats()["blocks_used"] > 0
    w.close()
    # the engine outlives the window; the window's conversation gives its KV blocks back
    assert engine.stats()["blocks_used"] == 0
    w.store.close()

    w2 = make_window(max_tokens=8)
    titles = [w2.chat_list.item(i).text() for i in range(w2.chat_list.count())]
    assert titles == ["Say hello.", "What is the capital of France?"]
    after = {c.id: (c.title, [(m.role, m.content) for m in w2.store.messages(c.id)]) for c in w2.store.chats()}
    assert after == before
    # the newest chat opens; the other one opens with its own system prompt and messages
    assert [v.text for v in w2.view.views] == [m[1] for m in after[w2.chat_id][1]]
    first = next(cid for cid in after if cid != w2.chat_id)
    w2.open_chat(first)
    assert w2.system_edit.text() == "You answer briefly."
    assert [(v.role, v.text) for v in w2.view.views] == after[first][1]
    assert all(m.complete for m in w2.store.messages(first))

    # search, rename, delete
    w2.search.setText("capital")
    assert [w2.chat_list.item(i).text() for i in range(w2.chat_list.count())] == ["What is the capital of France?"]
    w2.search.setText("")
    w2.rename_chat("Geography")
    assert w2.store.chat(first).title == "Geography"
    w2.delete_chat(confirm=False)
    assert [c.title for c in w2.store.chats()] == ["Say hello."]


def test_sigkill_mid_answer_keeps_what_was_shown(tmp_path, smollm):
    env = dict(os.environ, LLAMBA_DATA_DIR=str(tmp_path), QT_QPA_PLATFORM="offscreen",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, str(Path(__file__).with_name("kill_child.py")), str(smollm)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True, cwd=ROOT)
    shown = []
    deadline = time.monotonic() + 600   # a cold Numba cache compiles in the child first
    try:
        while len({m["shown"] for m in shown}) < 4 and time.monotonic() < deadline:
            ready, _, _ = select.select([child.stdout], [], [], 1.0)
            if not ready:
                assert child.poll() is None, "the app exited before it streamed"
                continue
            line = child.stdout.readline()
            if not line:
                break
            msg = json.loads(line)
            assert "error" not in msg, msg
            shown.append(msg)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    assert len({m["shown"] for m in shown}) >= 4, "the child never streamed"
    last = shown[-1]

    db = sqlite3.connect(f"file:{tmp_path / 'chats.sqlite3'}?mode=ro", uri=True)
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    rows = db.execute("SELECT role, content, complete, id FROM messages ORDER BY position").fetchall()
    assert [r[0] for r in rows] == ["user", "assistant"]
    assert rows[0][1] == "Count from 1 to 300, separated by commas."
    role, content, complete, mid = rows[1]
    assert mid == last["message_id"] and complete == 0
    # everything that was on screen is in the database (it is saved before it is shown)
    assert content.startswith(last["shown"]) and len(last["shown"]) > 0
