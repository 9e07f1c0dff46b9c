"""Chat history in SQLite (WAL mode).

Every message is a row committed the moment it exists; a streaming answer is
the same row, updated and committed before each batch of its text is shown, so
killing the app mid-answer loses nothing that was on screen.  WAL keeps those
small commits cheap and the file readable after a crash.
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id       INTEGER PRIMARY KEY,
    title    TEXT NOT NULL,
    system   TEXT NOT NULL DEFAULT '',
    created  REAL NOT NULL,
    updated  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id       INTEGER PRIMARY KEY,
    chat_id  INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    role     TEXT NOT NULL,
    content  TEXT NOT NULL,
    complete INTEGER NOT NULL DEFAULT 1,
    stats    TEXT NOT NULL DEFAULT '{}',
    created  REAL NOT NULL,
    UNIQUE (chat_id, position)
);
CREATE INDEX IF NOT EXISTS messages_chat ON messages(chat_id, position);
"""


@dataclass
class Chat:
    id: int
    title: str
    system: str
    updated: float


@dataclass
class Message:
    id: int
    position: int
    role: str
    content: str
    complete: bool = True
    stats: dict = field(default_factory=dict)

    def as_turn(self) -> dict:
        return {"role": self.role, "content": self.content}


class ChatStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        # autocommit mode: each statement commits on its own, so nothing waits in
        # an open transaction when the process dies
        self.db = sqlite3.connect(str(self.path), isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")     # durable across a process kill in WAL
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    # ---- chats -------------------------------------------------------------------
    def new_chat(self, title: str = "New chat", system: str = "") -> int:
        now = time.time()
        cur = self.db.execute("INSERT INTO chats(title, system, created, updated) VALUES (?,?,?,?)",
                              (title, system, now, now))
        return cur.lastrowid

    def chats(self, search: str = "") -> list[Chat]:
        """Newest first; `search` matches titles and message text."""
        if search:
            like = f"%{search}%"
            rows = self.db.execute(
                "SELECT id, title, system, updated FROM chats WHERE title LIKE ?1 OR id IN "
                "(SELECT chat_id FROM messages WHERE content LIKE ?1) ORDER BY updated DESC, id DESC",
                (like,))
        else:
            rows = self.db.execute("SELECT id, title, system, updated FROM chats ORDER BY updated DESC, id DESC")
        return [Chat(*r) for r in rows]

    def chat(self, chat_id: int) -> Chat | None:
        r = self.db.execute("SELECT id, title, system, updated FROM chats WHERE id=?", (chat_id,)).fetchone()
        return Chat(*r) if r else None

    def rename(self, chat_id: int, title: str) -> None:
        self.db.execute("UPDATE chats SET title=? WHERE id=?", (title.strip() or "Untitled", chat_id))

    def set_system(self, chat_id: int, system: str) -> None:
        self.db.execute("UPDATE chats SET system=? WHERE id=?", (system, chat_id))

    def delete(self, chat_id: int) -> None:
        self.db.execute("DELETE FROM chats WHERE id=?", (chat_id,))

    def _touch(self, chat_id: int) -> None:
        self.db.execute("UPDATE chats SET updated=? WHERE id=?", (time.time(), chat_id))

    # ---- messages ----------------------------------------------------------------
    def messages(self, chat_id: int) -> list[Message]:
        rows = self.db.execute("SELECT id, position, role, content, complete, stats FROM messages "
                               "WHERE chat_id=? ORDER BY position", (chat_id,))
        return [Message(i, p, r, c, bool(done), json.loads(s or "{}")) for i, p, r, c, done, s in rows]

    def add(self, chat_id: int, role: str, content: str, complete: bool = True) -> Message:
        with self.db:
            pos = self.db.execute("SELECT COALESCE(MAX(position)+1, 0) FROM messages WHERE chat_id=?",
                                  (chat_id,)).fetchone()[0]
            cur = self.db.execute("INSERT INTO messages(chat_id, position, role, content, complete, created) "
                                  "VALUES (?,?,?,?,?,?)", (chat_id, pos, role, content, int(complete), time.time()))
            self._touch(chat_id)
        return Message(cur.lastrowid, pos, role, content, complete)

    def update(self, message_id: int, content: str, complete: bool = False, stats: dict | None = None) -> None:
        if stats is None:
            self.db.execute("UPDATE messages SET content=?, complete=? WHERE id=?",
                            (content, int(complete), message_id))
        else:
            self.db.execute("UPDATE messages SET content=?, complete=?, stats=? WHERE id=?",
                            (content, int(complete), json.dumps(stats), message_id))

    def truncate(self, chat_id: int, position: int) -> None:
        """Drop the messages at `position` and after (regenerate, edit)."""
        self.db.execute("DELETE FROM messages WHERE chat_id=? AND position>=?", (chat_id, position))

    def clear(self, chat_id: int) -> None:
        self.truncate(chat_id, 0)
