"""The clients' API keys: a file of `name key [max_requests=N] [daily_tokens=N]` lines, read by the
gateway and the OpenAI-compatible service.

Only sha256 hashes of the keys leave this module (the gateway's rendered config holds hashes, and a
presented key is hashed and compared exactly). `max_requests` caps what one key may have running and
waiting at once (default `DEFAULT_MAX_REQUESTS`), so one client cannot take every decode slot;
`daily_tokens` the prompt + completion tokens it may use a day (UTC) on the /v1 routes (dualend.ops.usage;
default: no quota).
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from pathlib import Path

from .host import write_private_file

DEFAULT_MAX_REQUESTS = 16  # of the 32 decode slots a deployment has by default
BEARER = "Bearer "
MAX_NAME_CHARS = 64  # a name travels as the request's `client` (contract.MAX_CLIENT_CHARS)


class KeysFileError(RuntimeError):
    pass


@dataclass(frozen=True)
class ApiKey:
    name: str
    key_sha256: str     # hex
    max_requests: int   # running + waiting, per key
    daily_tokens: int | None = None  # prompt + completion tokens a day (UTC); None: no quota


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def read_keys(path: Path, default_max_requests: int = DEFAULT_MAX_REQUESTS) -> dict[str, ApiKey]:
    """{sha256 of the key: ApiKey} from lines `name key [max_requests=N] [daily_tokens=N]`; blank lines
    and # comments ignored."""
    keys = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"{path}:{number}"
        if (len(parts) < 2 or len(parts[1]) < 16 or not parts[1].isalnum() or not parts[0].isidentifier()
                or len(parts[0]) > MAX_NAME_CHARS):
            raise KeysFileError(f"{where}: expected `name key [max_requests=N] [daily_tokens=N]` with a name of "
                                f"letters, digits and _ (at most {MAX_NAME_CHARS}) and an alphanumeric key of 16+ "
                                "characters")
        settings = {"max_requests": default_max_requests, "daily_tokens": None}
        for field in parts[2:]:
            setting, _, value = field.partition("=")
            if setting not in settings or not value.isdigit() or int(value) < 1:
                raise KeysFileError(f"{where}: after the key come max_requests=N and daily_tokens=N, each N >= 1, "
                                    f"not {field!r}")
            settings[setting] = int(value)
        digest = key_hash(parts[1])
        keys[digest] = ApiKey(parts[0], digest, **settings)
    if not keys:
        raise KeysFileError(f"{path} holds no API key")
    return keys


class OncePerProblem:
    """`report(message)` passed on only when the message differs from the last one: a problem said once,
    not at every look (`clear()` once it is gone)."""

    def __init__(self, report):
        self.report, self.last = report, None

    def __call__(self, message: str) -> None:
        if message != self.last:
            self.report(message)
            self.last = message

    def clear(self) -> None:
        self.last = None


class KeysFile:
    """The keys file, read again once it changes, so that a key added or revoked takes effect without a
    restart. A change that does not read (a typo mid-edit) keeps the keys read before, and says why."""

    def __init__(self, path: Path, on_error=print):
        self.path, self.on_error = Path(path), OncePerProblem(on_error)
        self._stamp = self._stamp_now()
        self.keys = read_keys(self.path)  # at start a bad file is refused outright

    def _stamp_now(self) -> tuple[int, int, int]:
        status = self.path.stat()
        return status.st_mtime_ns, status.st_size, status.st_ino

    def current(self) -> dict[str, ApiKey]:
        self.changed()
        return self.keys

    def changed(self) -> bool:
        """Whether the file now holds other keys than before (taken in as `keys` when it does)."""
        try:
            stamp = self._stamp_now()
            if stamp == self._stamp:
                return False
            self._stamp = stamp
            keys = read_keys(self.path)
        except (OSError, KeysFileError) as error:
            self.on_error(f"API keys not reread: {error}; the keys read before stay in force")
            return False
        self.on_error.clear()
        found, self.keys = keys != self.keys, keys
        return found


def keyed_salt(name: str, salt: str = "") -> str:
    """A request's `cache_salt` under its key's name (names hold no /): one key's prefixes are its own."""
    return f"{name}/{salt}"


def client_of(authorization: str | None, keys: dict[str, ApiKey]) -> ApiKey | None:
    """The key an `Authorization: Bearer <key>` header presents, compared exactly (the scheme's case
    too); None when missing or unknown."""
    if not authorization or not authorization.startswith(BEARER):
        return None
    digest = key_hash(authorization[len(BEARER):])
    found = keys.get(digest)
    return found if found is not None and hmac.compare_digest(found.key_sha256, digest) else None


def write_new_keys(path: Path, name: str = "default") -> str:
    key = secrets.token_hex(24)
    write_private_file(path, f"{name} {key}\n")
    return key
