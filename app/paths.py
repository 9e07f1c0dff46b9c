"""Where the app keeps its chat database and settings.

`LLAMBA_DATA_DIR` (or `--data-dir`) points everything at another folder, which
the tests use to run against a throwaway directory."""
from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def data_dir() -> Path:
    d = Path(os.environ.get("LLAMBA_DATA_DIR") or platformdirs.user_data_dir("llamba", appauthor=False))
    d.mkdir(parents=True, exist_ok=True)
    return d


def chats_db() -> Path:
    return data_dir() / "chats.sqlite3"


def settings_file() -> Path:
    return data_dir() / "settings.ini"
