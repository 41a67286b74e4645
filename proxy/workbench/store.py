"""Sessions and their turns in SQLite; turns form a tree, so any turn can be branched.

A turn's parent is the turn it follows (none for a session's first turn). The history of a
new turn is its ancestors' messages in order, so a branch repeats its parent's prefix
exactly: the traffic the proxy's cache is for. Writes are small and local, so they run
inline on the event loop.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, scenario TEXT NOT NULL, title TEXT NOT NULL, system TEXT NOT NULL, created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS turns (
    id TEXT PRIMARY KEY, session_id TEXT NOT NULL REFERENCES sessions(id), parent_id TEXT,
    seq INTEGER NOT NULL, user TEXT NOT NULL, messages TEXT NOT NULL, final TEXT NOT NULL,
    calls TEXT NOT NULL, tools TEXT NOT NULL, error TEXT, created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS turns_by_session ON turns(session_id, seq);
"""


class NotFound(Exception):
    pass


class Store:
    def __init__(self, path: Path | str) -> None:
        self.db = sqlite3.connect(str(path), check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def create_session(self, scenario: str, title: str, system: str) -> dict[str, Any]:
        sid = uuid.uuid4().hex[:12]
        with self.db:
            self.db.execute(
                "INSERT INTO sessions VALUES (?, ?, ?, ?, ?)", (sid, scenario, title, system, time.time())
            )
        return self.session(sid)

    def session(self, sid: str) -> dict[str, Any]:
        row = self.db.execute("SELECT * FROM sessions WHERE id = ?", (sid,)).fetchone()
        if row is None:
            raise NotFound(f"no session {sid}")
        return dict(row)

    def sessions(self) -> list[dict[str, Any]]:
        rows = self.db.execute(
            "SELECT s.id, s.scenario, s.title, s.created, COUNT(t.id) AS turns FROM sessions s "
            "LEFT JOIN turns t ON t.session_id = s.id GROUP BY s.id ORDER BY s.created DESC"
        )
        return [dict(r) for r in rows]

    def add_turn(
        self,
        sid: str,
        parent: str | None,
        user: str,
        messages: list[dict[str, Any]],
        final: str,
        calls: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        error: str | None,
    ) -> dict[str, Any]:
        self.session(sid)
        if parent is not None:
            self.turn(sid, parent)
        tid = uuid.uuid4().hex[:12]
        (seq,) = self.db.execute("SELECT COUNT(*) FROM turns WHERE session_id = ?", (sid,)).fetchone()
        with self.db:
            self.db.execute(
                "INSERT INTO turns VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    tid,
                    sid,
                    parent,
                    seq,
                    user,
                    json.dumps(messages),
                    final,
                    json.dumps(calls),
                    json.dumps(tools),
                    error,
                    time.time(),
                ),
            )
        return self.turn(sid, tid)

    def turn(self, sid: str, tid: str) -> dict[str, Any]:
        row = self.db.execute("SELECT * FROM turns WHERE id = ? AND session_id = ?", (tid, sid)).fetchone()
        if row is None:
            raise NotFound(f"no turn {tid} in session {sid}")
        return _turn(row)

    def turns(self, sid: str) -> list[dict[str, Any]]:
        self.session(sid)
        rows = self.db.execute("SELECT * FROM turns WHERE session_id = ? ORDER BY seq", (sid,))
        return [_turn(r) for r in rows]

    def path(self, sid: str, tid: str | None) -> list[dict[str, Any]]:
        """The turns from the session's root down to ``tid`` (empty for None)."""
        out = []
        while tid is not None:
            turn = self.turn(sid, tid)
            out.append(turn)
            tid = turn["parent_id"]
        return out[::-1]

    def history(self, sid: str, tid: str | None) -> list[dict[str, Any]]:
        return [m for turn in self.path(sid, tid) for m in turn["messages"]]


def _turn(row: sqlite3.Row) -> dict[str, Any]:
    out = dict(row)
    for key in ("messages", "calls", "tools"):
        out[key] = json.loads(out[key])
    return out
