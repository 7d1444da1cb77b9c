"""The gateway's token table: which bearer token belongs to which phone.

File format: one phone per line, ``<token> <phone-name>`` or, as
``flowerbed bridge enroll`` writes it, ``sha256:<64 hex digits> <phone-name>`` (the
token's SHA-256, so the file does not hold usable tokens); blank lines and lines
starting with ``#`` are ignored. Tokens and names must both be unique.

In memory the table holds only SHA-256 digests. A presented token is hashed and
compared with every digest with :func:`hmac.compare_digest`, without stopping at a
match, so the time a lookup takes says nothing about which stored token is closest.
Plain SHA-256 (no salt, no slow hash) is enough here because tokens are random
secrets of at least :data:`MIN_TOKEN_CHARS` characters, not passwords a person picks:
a dictionary attack has nothing to guess.

:class:`TokenTable` re-reads its file when it changes (size, modification time or
inode), at most once per ``check_interval_s``, so phones are added, revoked and given
new tokens without restarting the gateway. A file that became invalid is refused
with one error line and the previous table stays in force.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

log = logging.getLogger("flowerbed.bridge")

MIN_TOKEN_CHARS = 16
"""Shorter tokens are refused: they are guessable."""
HASH_PREFIX = "sha256:"
_TOKEN_RE = re.compile(r"^[A-Za-z0-9._~+/=-]+$")
_HASH_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class TokenFileError(ValueError):
    """A token file that cannot be used; the message names the file and line."""


def hash_token(token: str) -> str:
    """The stored form of a token: ``sha256:`` and the hex SHA-256 of its UTF-8."""
    return HASH_PREFIX + hashlib.sha256(token.encode("utf-8")).hexdigest()


def check_phone_name(name: str) -> str:
    """``name`` if it is a valid phone name (1-64 of A-Z a-z 0-9 . _ -), else raise."""
    if not _NAME_RE.match(name):
        raise TokenFileError(
            f"phone name {name!r} must be 1-64 characters of A-Z a-z 0-9 . _ -"
        )
    return name


def parse_tokens(
    text: str, source: str = "<tokens>", allow_empty: bool = False
) -> dict[str, str]:
    """Parse token-table text into ``{sha256:digest: phone_name}``.

    Plain tokens are hashed on the way in; hashed lines are kept as they are. A
    table without tokens is an error unless ``allow_empty`` (every phone revoked).

    Raises
    ------
    TokenFileError
        On a malformed line, a short token, or a repeated token or name.
    """
    table: dict[str, str] = {}
    names: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        where = f"{source}:{lineno}"
        if len(fields) != 2:
            raise TokenFileError(
                f"{where}: expected '<token> <phone-name>', got {len(fields)} fields"
            )
        token, name = fields
        if token.startswith(HASH_PREFIX):
            if not _HASH_RE.match(token):
                raise TokenFileError(
                    f"{where}: a hashed token is 'sha256:' and 64 lowercase hex digits"
                )
            digest = token
        elif len(token) < MIN_TOKEN_CHARS or not _TOKEN_RE.match(token):
            raise TokenFileError(
                f"{where}: token must be at least {MIN_TOKEN_CHARS} characters of "
                "A-Z a-z 0-9 . _ ~ + / = -"
            )
        else:
            digest = hash_token(token)
        try:
            check_phone_name(name)
        except TokenFileError as err:
            raise TokenFileError(f"{where}: {err}") from None
        if digest in table:
            raise TokenFileError(
                f"{where}: token repeated (first used by {table[digest]})"
            )
        if name in names:
            raise TokenFileError(f"{where}: phone name {name!r} repeated")
        table[digest] = name
        names.add(name)
    if not table and not allow_empty:
        raise TokenFileError(f"{source}: no tokens; add lines '<token> <phone-name>'")
    return table


def load_tokens(path: str | Path, allow_empty: bool = False) -> dict[str, str]:
    """Read a token file (see module docstring) into ``{sha256:digest: phone_name}``."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise TokenFileError(f"cannot read token file {p}: {reason}") from err
    return parse_tokens(text, source=str(p), allow_empty=allow_empty)


def _file_key(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class TokenTable:
    """Bearer tokens of the phones, by SHA-256 digest; reloaded when its file changes.

    Parameters
    ----------
    digests : Mapping[str, str]
        ``{sha256:digest: phone_name}`` (see :func:`parse_tokens`).
    path : str | Path | None
        The token file to watch; None for a fixed table.
    check_interval_s : float
        Least seconds between two checks of the file.
    clock : Callable[[], float]
        Monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        digests: Mapping[str, str],
        path: str | Path | None = None,
        check_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._digests = [(d.encode("ascii"), n) for d, n in digests.items()]
        self.path = Path(path).expanduser() if path is not None else None
        self.check_interval_s = check_interval_s
        self.clock = clock
        self._key = _file_key(self.path) if self.path is not None else None
        self._refused = False
        self._refused_key: tuple[int, int, int] | None = None
        """The file version last refused (logged once, not retried)."""
        self._checked = clock()
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str | Path, check_interval_s: float = 1.0) -> TokenTable:
        """The table of a token file, watched for changes (raises TokenFileError).

        An empty file is allowed (no phone enrolled yet), with a warning.
        """
        digests = load_tokens(path, allow_empty=True)
        if not digests:
            log.warning(
                "token file %s lists no phones yet; enrol one with "
                "'flowerbed bridge enroll --tokens %s --phone NAME --url URL'",
                path,
                path,
            )
        return cls(digests, path, check_interval_s)

    @classmethod
    def from_tokens(cls, tokens: Mapping[str, str]) -> TokenTable:
        """A fixed table from plain ``{token: phone_name}`` (tests, embedding)."""
        return cls({hash_token(t): n for t, n in tokens.items()})

    def names(self) -> list[str]:
        """The phone names the table knows, in file order."""
        self._maybe_reload()
        return [name for _, name in self._digests]

    def lookup(self, token: str) -> str | None:
        """The phone name of ``token``, or None; constant time in the token."""
        self._maybe_reload()
        digest = hash_token(token).encode("ascii")
        found: str | None = None
        for stored, name in self._digests:
            if hmac.compare_digest(stored, digest):
                found = name
        return found

    def _maybe_reload(self) -> None:
        if self.path is None:
            return
        now = self.clock()
        with self._lock:
            if now - self._checked < self.check_interval_s:
                return
            self._checked = now
            key = _file_key(self.path)
            if key == self._key or (self._refused and key == self._refused_key):
                return
            try:
                digests = load_tokens(self.path, allow_empty=True)
            except TokenFileError as err:
                self._refused, self._refused_key = True, key
                log.error("token file change refused, previous tokens kept: %s", err)
                return
            before = {n for _, n in self._digests}
            self._digests = [(d.encode("ascii"), n) for d, n in digests.items()]
            self._key = key
            after = set(digests.values())
            log.info(
                "token file %s reloaded: %d phones (added %s, removed %s)",
                self.path,
                len(after),
                sorted(after - before) or "none",
                sorted(before - after) or "none",
            )
