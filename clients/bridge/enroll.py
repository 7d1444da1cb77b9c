"""Enrolment: issue, rotate and revoke phone tokens while the gateway runs.

``flowerbed bridge enroll`` writes a new random token's SHA-256 into the token file
(the gateway re-reads it within a second, see
:class:`~flowerbed.clients.bridge.tokens.TokenTable`) and prints an *enrolment URI*
that carries everything the app needs, as text and as a QR code::

    flowerbed://enroll?v=1&gateway=https%3A%2F%2Fgw.lan%3A8470&phone=pixel-7
        &token=<token>&pin=sha256%2F<base64 SHA-256 of the certificate's public key>

``pin`` is present when the gateway serves HTTPS with a certificate given to
``enroll``: the app then trusts exactly that key (public-key pinning in the format
of RFC 7469, section 2.4), so a self-signed certificate works without installing it
on the phone. The token itself is printed once and never stored on the gateway.
"""

from __future__ import annotations

import base64
import hashlib
import io
import secrets
from pathlib import Path
from urllib.parse import quote, urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from flowerbed.clients.bridge.files import write_atomic
from flowerbed.clients.bridge.tokens import (
    TokenFileError,
    check_phone_name,
    hash_token,
    parse_tokens,
)

URI_SCHEME = "flowerbed"
URI_VERSION = 1
TOKEN_BYTES = 32
"""Random bytes per token (256 bits; URL-safe base64, 43 characters)."""


class EnrolmentError(ValueError):
    """An enrolment request that cannot be carried out; the message says why."""


def spki_pin(cert_pem: bytes) -> str:
    """``sha256/<base64>`` of a certificate's SubjectPublicKeyInfo (RFC 7469, 2.4).

    The first certificate of a PEM chain is the gateway's own.
    """
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as err:
        raise EnrolmentError(f"not a PEM certificate: {err}") from err
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256/" + base64.b64encode(hashlib.sha256(spki).digest()).decode("ascii")


def enrolment_uri(gateway_url: str, phone: str, token: str, pin: str | None) -> str:
    """The URI the app reads (typed, pasted or scanned as a QR code).

    Raises :class:`EnrolmentError` for a gateway URL that is not ``http(s)://host``
    or a plain-HTTP gateway given a pin (pins are for TLS).
    """
    parts = urlsplit(gateway_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise EnrolmentError(
            f"gateway URL {gateway_url!r} must be http(s)://host[:port], the address "
            "phones reach"
        )
    if pin is not None and parts.scheme != "https":
        raise EnrolmentError("a certificate pin needs an https:// gateway URL")
    query = [
        ("v", str(URI_VERSION)),
        ("gateway", gateway_url.rstrip("/")),
        ("phone", phone),
        ("token", token),
    ]
    if pin is not None:
        query.append(("pin", pin))
    return f"{URI_SCHEME}://enroll?" + "&".join(
        f"{k}={quote(v, safe='')}" for k, v in query
    )


def _read_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise EnrolmentError(f"cannot read token file {path}: {err}") from err


def _line_name(line: str) -> str | None:
    fields = line.split()
    if len(fields) == 2 and not line.lstrip().startswith("#"):
        return fields[1]
    return None


def issue_token(path: str | Path, phone: str, *, rotate: bool = False) -> str:
    """Give ``phone`` a new random token; return it (the file keeps its hash only).

    ``rotate=False`` enrols a new phone (an error if the name is taken);
    ``rotate=True`` replaces the token of an enrolled phone, which keeps its name
    and so its Flower node. The previous token stops working at the gateway's next
    reload (within a second).
    """
    p = Path(path).expanduser()
    check_phone_name(phone)
    lines = _read_lines(p)
    names = [_line_name(line) for line in lines]
    if rotate and phone not in names:
        raise EnrolmentError(f"no phone {phone!r} in {p}; enrol it first")
    if not rotate and phone in names:
        raise EnrolmentError(
            f"phone {phone!r} is already enrolled in {p}; rotate its token or pick "
            "another name"
        )
    token = secrets.token_urlsafe(TOKEN_BYTES)
    entry = f"{hash_token(token)} {phone}"
    if rotate:
        lines = [
            entry if n == phone else line for n, line in zip(names, lines, strict=True)
        ]
    else:
        lines.append(entry)
    _check(lines, p)
    write_atomic(p, "".join(line + "\n" for line in lines).encode())
    return token


def revoke(path: str | Path, phone: str) -> None:
    """Remove ``phone``'s token: the gateway refuses it within a second."""
    p = Path(path).expanduser()
    lines = _read_lines(p)
    kept = [line for line in lines if _line_name(line) != phone]
    if len(kept) == len(lines):
        raise EnrolmentError(f"no phone {phone!r} in {p}")
    _check(kept, p)
    write_atomic(p, "".join(line + "\n" for line in kept).encode())


def enrolled(path: str | Path) -> list[str]:
    """Phone names in the token file, in file order."""
    p = Path(path).expanduser()
    return [n for n in map(_line_name, _read_lines(p)) if n is not None]


def _check(lines: list[str], path: Path) -> None:
    """Refuse to write a file the gateway would refuse to load."""
    try:
        parse_tokens("\n".join(lines), source=str(path), allow_empty=True)
    except TokenFileError as err:
        raise EnrolmentError(f"token file would become invalid: {err}") from err


def qr_text(uri: str) -> str | None:
    """The URI as a QR code in text blocks (light on dark terminals), or None when
    the optional ``qrcode`` package is missing (``pip install flowerbed[phones]``)."""
    try:
        import qrcode
    except ImportError:
        return None
    code = qrcode.QRCode(border=2)
    code.add_data(uri)
    out = io.StringIO()
    code.print_ascii(out=out, invert=True)
    return out.getvalue()
