"""Tokens used per API key and day (UTC), in SQLite, so usage and quotas survive restarts.

    python -m dualend.ops.usage                     # every key and day, from build/gateway/usage.sqlite
    python -m dualend.ops.usage --db PATH --days 7

The OpenAI-compatible service records every answered request (prompt, cached and completion tokens)
and refuses a key whose day's tokens reached its `daily_tokens` (api_keys) with 429 `quota_exceeded`.
A request admitted under the quota is answered whole, so a day may end above the quota by what the
last admitted request used; the next one is refused.
"""
from __future__ import annotations

import argparse
import sqlite3
import threading
import time
from pathlib import Path

DEFAULT_DB = Path(__file__).resolve().parents[2] / "build" / "gateway" / "usage.sqlite"
SCHEMA = """CREATE TABLE IF NOT EXISTS usage (
    key TEXT NOT NULL, day TEXT NOT NULL, requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, PRIMARY KEY (key, day))"""


def today(now: float | None = None) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(time.time() if now is None else now))


def seconds_to_next_day(now: float | None = None) -> int:
    now = time.time() if now is None else now
    return int(86400 - now % 86400) or 1


class UsageStore:
    def __init__(self, path: Path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=10)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable across a crash of the process
        self._db.execute(SCHEMA)
        self._lock = threading.Lock()

    def record(self, key: str, prompt: int, cached: int, completion: int, day: str | None = None) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO usage VALUES (?, ?, 1, ?, ?, ?) ON CONFLICT (key, day) DO UPDATE SET "
                "requests = requests + 1, prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
                "cached_tokens = cached_tokens + excluded.cached_tokens, "
                "completion_tokens = completion_tokens + excluded.completion_tokens",
                (key, day or today(), prompt, cached, completion))

    def tokens(self, key: str, day: str | None = None) -> int:
        """Prompt + completion tokens the key used that day (today by default)."""
        with self._lock:
            row = self._db.execute("SELECT prompt_tokens + completion_tokens FROM usage WHERE key = ? AND day = ?",
                                   (key, day or today())).fetchone()
        return row[0] if row else 0

    def rows(self, since_day: str = "") -> list[tuple]:
        """(day, key, requests, prompt, cached, completion), newest day first."""
        with self._lock:
            return self._db.execute("SELECT day, key, requests, prompt_tokens, cached_tokens, completion_tokens "
                                    "FROM usage WHERE day >= ? ORDER BY day DESC, key", (since_day,)).fetchall()

    def close(self) -> None:
        self._db.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", type=Path, default=DEFAULT_DB)
    parser.add_argument("--days", type=int, default=0, help="only the last N days (0: all)")
    args = parser.parse_args(argv)
    if not args.db.exists():
        raise SystemExit(f"{args.db} does not exist: no request has been answered through /v1 with it yet")
    store = UsageStore(args.db)
    since = today(time.time() - 86400 * (args.days - 1)) if args.days else ""
    print(f"{'day':10}  {'key':20} {'requests':>9} {'prompt':>10} {'cached':>10} {'completion':>11}")
    for day, key, requests, prompt, cached, completion in store.rows(since):
        print(f"{day:10}  {key:20} {requests:>9} {prompt:>10} {cached:>10} {completion:>11}")
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
