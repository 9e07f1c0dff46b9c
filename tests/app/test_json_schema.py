"""The chat settings' answer JSON schema: the window sends it, the worker holds the answer to it."""
from __future__ import annotations

import json

ANSWER_TIMEOUT_MS = 120_000
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_answer_follows_the_settings_json_schema(make_window, qtbot):
    import jsonschema
    w = make_window(json_schema=json.dumps(SCHEMA), max_tokens=60)
    with qtbot.waitSignal(w.worker.finished, timeout=ANSWER_TIMEOUT_MS) as done:
        w.send("Describe a person.")
    qtbot.waitUntil(lambda: not w.busy, timeout=10_000)
    answer = w.messages[-1].content
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert json.loads(done.args[1])["stop_reason"] == "stop"
    # a bad schema fails the turn with a message, and the next turn works again
    w.settings.json_schema = '{"type": "objekt"}'
    with qtbot.waitSignal(w.worker.failed, timeout=ANSWER_TIMEOUT_MS) as failed:
        w.send("Again.")
    assert "objekt" in failed.args[1]


def test_settings_dialog_json_schema_field(qtbot):
    from app.settings import Settings
    from app.settings_dialog import SettingsDialog
    d = SettingsDialog(Settings(json_schema='{"type": "object"}'))
    qtbot.addWidget(d)
    d.json_schema.setPlainText(' {"type": "array"} ')
    assert d.result_settings().json_schema == '{"type": "array"}'
