"""The gateway's token table: which bearer token belongs to which phone.

File format: one phone per line, ``<token> <phone-name>``; blank lines and lines
starting with ``#`` are ignored. Tokens and names must both be unique.
"""

from __future__ import annotations

import re
from pathlib import Path

MIN_TOKEN_CHARS = 16
"""Shorter tokens are refused: they are guessable."""
_TOKEN_RE = re.compile(r"^[A-Za-z0-9._~+/=-]+$")
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")


class TokenFileError(ValueError):
    """A token file that cannot be used; the message names the file and line."""


def parse_tokens(text: str, source: str = "<tokens>") -> dict[str, str]:
    """Parse token-table text into ``{token: phone_name}``.

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
        if len(token) < MIN_TOKEN_CHARS or not _TOKEN_RE.match(token):
            raise TokenFileError(
                f"{where}: token must be at least {MIN_TOKEN_CHARS} characters of "
                "A-Z a-z 0-9 . _ ~ + / = -"
            )
        if not _NAME_RE.match(name):
            raise TokenFileError(
                f"{where}: phone name {name!r} may use A-Z a-z 0-9 . _ -"
            )
        if token in table:
            raise TokenFileError(
                f"{where}: token repeated (first used by {table[token]})"
            )
        if name in names:
            raise TokenFileError(f"{where}: phone name {name!r} repeated")
        table[token] = name
        names.add(name)
    if not table:
        raise TokenFileError(f"{source}: no tokens; add lines '<token> <phone-name>'")
    return table


def load_tokens(path: str | Path) -> dict[str, str]:
    """Read a token file (see module docstring) into ``{token: phone_name}``."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as err:
        raise TokenFileError(f"cannot read token file {p}: {err.strerror}") from err
    return parse_tokens(text, source=str(p))
