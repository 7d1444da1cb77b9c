"""``flowerbed bridge``: run the phone gateway in front of a Flower SuperLink."""

from __future__ import annotations

import argparse
import logging
import math
import signal
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from flowerbed.clients.bridge.settings import GatewaySettings

DEFAULT_SUPERLINK = "127.0.0.1:8000"
"""Flower 1.41's SuperLink serves the Fleet API on its HTTP port (8000 by default)."""
DEFAULT_PORT = 8470

log = logging.getLogger("flowerbed.bridge")


def _number(
    kind: type[float] | type[int], low: float, inclusive: bool
) -> Callable[[str], float]:
    """An argparse type: a finite ``kind`` above ``low`` (or at it, ``inclusive``)."""
    bound = f">= {low:g}" if inclusive else f"> {low:g}"

    def parse(raw: str) -> float:
        try:
            value = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{raw!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"{raw!r}: must be finite and {bound}")
        return value

    return parse


def port_number(raw: str) -> int:
    """An argparse type: a TCP port, 0..65535 (0: any free port)."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 0..65535")
    return value


positive = _number(float, 0.0, inclusive=False)
non_negative = _number(float, 0.0, inclusive=True)
positive_int = _number(int, 1, inclusive=True)

SAME_NAMED: tuple[tuple[str, Callable[[str], float], str], ...] = (
    (
        "offline_after_s",
        positive,
        "deactivate a silent phone's node after this long (default %(default)g)",
    ),
    (
        "deadline_slack_s",
        non_negative,
        "task expiry after a config's deadline-s (default %(default)g)",
    ),
    (
        "pull_interval_s",
        positive,
        "idle node's pull interval (default %(default)g, as a SuperNode)",
    ),
    ("max_poll_s", positive, "cap on a phone's long poll (default %(default)g)"),
    (
        "max_connections",
        positive_int,
        "open phone connections at most (default %(default)d)",
    ),
    (
        "workers",
        positive_int,
        "threads for blocking work: registration, decoding (default %(default)d)",
    ),
    (
        "idle_timeout_s",
        positive,
        "close a connection that sends no whole request head for this long "
        "(default %(default)g)",
    ),
    (
        "read_timeout_s",
        positive,
        "close a connection whose body or answer stalls this long "
        "(default %(default)g)",
    ),
)
"""(GatewaySettings field, argparse type, help) of the options named after their
field: ``--offline-after-s`` sets ``offline_after_s``."""


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``bridge`` subcommand."""
    p = subparsers.add_parser(
        "bridge",
        help="phone gateway: each phone becomes its own Flower node",
        description=(
            "Serve the flowerbed phone protocol (android_client/PROTOCOL.md) and "
            "connect one Flower node per phone to the SuperLink's Fleet API."
        ),
    )
    p.add_argument(
        "--superlink",
        default=DEFAULT_SUPERLINK,
        help=f"SuperLink Fleet API host:port (default {DEFAULT_SUPERLINK})",
    )
    tls = p.add_mutually_exclusive_group()
    tls.add_argument(
        "--insecure", action="store_true", help="plain HTTP to the SuperLink"
    )
    tls.add_argument(
        "--root-certificates",
        metavar="PEM",
        help="CA bundle to verify the SuperLink (default: system CAs)",
    )
    p.add_argument(
        "--tokens",
        help="token file, lines '<token or sha256:hash> <phone-name>'; re-read on "
        "change (required to serve)",
    )
    p.add_argument(
        "--program",
        action="append",
        default=[],
        metavar="PTE",
        help="training program (.pte with its .pte.json from export-android) to serve "
        "to phones; repeat for more; the first is the default (config key "
        "'program' picks another)",
    )
    p.add_argument("--host", default="127.0.0.1", help="listen address for phones")
    p.add_argument(
        "--port",
        type=port_number,
        default=DEFAULT_PORT,
        help=f"listen port, 0..65535 (default {DEFAULT_PORT})",
    )
    p.add_argument(
        "--state-dir",
        help="keep phones' node keys here: node ids survive gateway restarts",
    )
    p.add_argument("--certfile", help="PEM certificate chain: serve phones HTTPS")
    p.add_argument("--keyfile", help="PEM private key of --certfile")
    d = GatewaySettings()
    p.add_argument(
        "--max-upload-mb",
        type=positive,
        default=d.max_upload_bytes / 2**20,
        help="largest result upload per task, MiB (default %(default)g)",
    )
    p.add_argument(
        "--chunk-kb",
        type=positive_int,
        default=d.chunk_bytes // 1024,
        help="largest upload chunk, KiB (default %(default)d)",
    )
    for name, kind, what in SAME_NAMED:
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            default=getattr(d, name),
            help=what,
        )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=run)
    _register_enrolment(p)


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    """Gateway limits and timings from parsed ``flowerbed bridge`` arguments."""
    return GatewaySettings(
        max_upload_bytes=int(args.max_upload_mb * 2**20),
        chunk_bytes=args.chunk_kb * 1024,
        **{name: getattr(args, name) for name, _, _ in SAME_NAMED},
    )


def _register_enrolment(p: argparse.ArgumentParser) -> None:
    tools = p.add_subparsers(
        dest="bridge_command",
        metavar="{enroll,rotate,revoke,list}",
        description="Manage phone tokens while the gateway runs (it re-reads the "
        "token file within a second). Without a command: serve.",
    )
    for name, what in (
        ("enroll", "enrol a new phone: print its token as an enrolment URI and QR"),
        ("rotate", "give an enrolled phone a new token (same Flower node)"),
    ):
        e = tools.add_parser(name, help=what, description=what)
        e.add_argument("--tokens", required=True, help="the gateway's token file")
        e.add_argument("--phone", required=True, help="phone name (A-Z a-z 0-9 . _ -)")
        e.add_argument(
            "--url",
            required=True,
            help="gateway URL as phones reach it, e.g. https://gateway.lan:8470",
        )
        e.add_argument(
            "--cert",
            help="the gateway's --certfile: pin its public key in the URI (HTTPS)",
        )
        e.set_defaults(func=run_enroll, rotate=name == "rotate")
    r = tools.add_parser("revoke", help="revoke a phone's token")
    r.add_argument("--tokens", required=True, help="the gateway's token file")
    r.add_argument("--phone", required=True, help="phone name")
    r.set_defaults(func=run_revoke)
    ls = tools.add_parser("list", help="list enrolled phones")
    ls.add_argument("--tokens", required=True, help="the gateway's token file")
    ls.set_defaults(func=run_list)


def run_enroll(args: argparse.Namespace) -> int:
    """``flowerbed bridge enroll|rotate``: new token, printed once as URI and QR."""
    from flowerbed.clients.bridge.enroll import (
        EnrolmentError,
        enrolment_uri,
        issue_token,
        qr_text,
        spki_pin,
    )
    from flowerbed.clients.bridge.tokens import TokenFileError

    try:
        pin = spki_pin(Path(args.cert).read_bytes()) if args.cert else None
        # Build the URI first: a bad URL must not leave a token in the file.
        enrolment_uri(args.url, args.phone, "x" * 16, pin)
        token = issue_token(args.tokens, args.phone, rotate=args.rotate)
    except OSError as err:
        print(f"flowerbed bridge: error: cannot read {args.cert}: {err.strerror}")
        return 2
    except (EnrolmentError, TokenFileError) as err:
        print(f"flowerbed bridge: error: {err}")
        return 2
    uri = enrolment_uri(args.url, args.phone, token, pin)
    verb = "new token for" if args.rotate else "enrolled"
    print(f"{verb} phone {args.phone!r}; the gateway picks it up within a second.")
    print("Scan the QR code or paste the URI in the app (shown once; keep it secret):")
    qr = qr_text(uri)
    if qr is not None:
        print(qr)
    else:
        print("(pip install qrcode to draw it as a QR code here)")
    print(uri)
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    """``flowerbed bridge revoke``: remove a phone's token."""
    from flowerbed.clients.bridge.enroll import EnrolmentError, revoke
    from flowerbed.clients.bridge.tokens import TokenFileError

    try:
        revoke(args.tokens, args.phone)
    except (EnrolmentError, TokenFileError) as err:
        print(f"flowerbed bridge: error: {err}")
        return 2
    print(f"revoked phone {args.phone!r}; the gateway refuses it within a second.")
    return 0


def run_list(args: argparse.Namespace) -> int:
    """``flowerbed bridge list``: the enrolled phone names."""
    from flowerbed.clients.bridge.enroll import EnrolmentError, enrolled

    try:
        names = enrolled(args.tokens)
    except EnrolmentError as err:
        print(f"flowerbed bridge: error: {err}")
        return 2
    print("\n".join(names) if names else f"no phones in {args.tokens}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Serve phones until SIGINT/SIGTERM; nodes are deactivated on the way out."""
    from flowerbed.clients.bridge.gateway import Gateway
    from flowerbed.clients.bridge.programs import ProgramError, load_program
    from flowerbed.clients.bridge.relay import StateDirError, SuperLinkConnector
    from flowerbed.clients.bridge.server import GatewayServer
    from flowerbed.clients.bridge.tokens import TokenFileError, TokenTable

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # One line per Fleet API call and phone would drown the gateway's own log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if (args.certfile is None) != (args.keyfile is None):
        log.error("--certfile and --keyfile go together (HTTPS needs both)")
        return 2
    for path in (args.certfile, args.keyfile, args.root_certificates):
        if path is not None and not Path(path).is_file():
            log.error("file not found: %s", path)
            return 2
    if args.tokens is None:
        log.error("--tokens FILE is required to serve (create it with 'enroll')")
        return 2
    try:
        tokens = TokenTable.from_file(args.tokens)
        programs = [load_program(path) for path in args.program]
        settings = settings_from_args(args)
        connector = SuperLinkConnector(
            args.superlink,
            insecure=args.insecure,
            root_certificates=args.root_certificates,
            state_dir=args.state_dir,
        )
    except (TokenFileError, StateDirError, ProgramError, ValueError) as err:
        log.error("%s", err)
        return 2
    gateway = Gateway(tokens, connector, settings, programs=programs)
    for program in programs:
        log.info(
            "serving program %r (sha256 %s, %d bytes, %d parameters, %d state arrays)",
            program.name,
            program.sha256[:12],
            len(program.data),
            len(program.parameters),
            len(program.state),
        )
        if program.evaluate_method is None:
            log.warning(
                "program %r has no evaluation method (exported before it had one): "
                "phones fail its evaluate tasks; export it again",
                program.name,
            )
    try:
        server = GatewayServer(
            gateway, args.host, args.port, args.certfile, args.keyfile
        )
    except ssl.SSLError as err:
        log.error("cannot use --certfile/--keyfile: %s", err)
        return 2
    except OSError as err:
        log.error("cannot listen on %s:%s: %s", args.host, args.port, err)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    server.start()
    log.info(
        "%d phones known; SuperLink %s (%s)",
        len(tokens.names()),
        args.superlink,
        "insecure" if args.insecure else "TLS",
    )
    stop.wait()
    server.stop()
    return 0
