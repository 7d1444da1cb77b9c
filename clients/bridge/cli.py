"""``flowerbed bridge``: run the phone gateway in front of a Flower SuperLink."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path
from types import FrameType

from flowerbed.clients.bridge.gateway import Gateway, GatewaySettings
from flowerbed.clients.bridge.relay import SuperLinkConnector
from flowerbed.clients.bridge.server import GatewayServer
from flowerbed.clients.bridge.tokens import TokenFileError, load_tokens

DEFAULT_SUPERLINK = "127.0.0.1:8000"
"""Flower 1.41's SuperLink serves the Fleet API on its HTTP port (8000 by default)."""
DEFAULT_PORT = 8470

log = logging.getLogger("flowerbed.bridge")


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
    p.add_argument("--tokens", required=True, help="token file: '<token> <phone-name>'")
    p.add_argument("--host", default="127.0.0.1", help="listen address for phones")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="listen port")
    p.add_argument(
        "--state-dir",
        help="keep phones' node keys here: node ids survive gateway restarts",
    )
    p.add_argument("--certfile", help="PEM certificate chain: serve phones HTTPS")
    p.add_argument("--keyfile", help="PEM private key of --certfile")
    d = GatewaySettings()
    p.add_argument(
        "--max-upload-mb",
        type=float,
        default=d.max_upload_bytes / 2**20,
        help="largest result upload per task, MiB (default %(default)g)",
    )
    p.add_argument(
        "--chunk-kb",
        type=int,
        default=d.chunk_bytes // 1024,
        help="largest upload chunk, KiB (default %(default)d)",
    )
    p.add_argument(
        "--offline-after-s",
        type=float,
        default=d.offline_after_s,
        help="deactivate a silent phone's node after this long (default %(default)g)",
    )
    p.add_argument(
        "--deadline-slack-s",
        type=float,
        default=d.deadline_slack_s,
        help="task expiry after a config's deadline-s (default %(default)g)",
    )
    p.add_argument(
        "--pull-interval-s",
        type=float,
        default=d.pull_interval_s,
        help="idle node's pull interval (default %(default)g, as a SuperNode)",
    )
    p.add_argument(
        "--max-poll-s",
        type=float,
        default=d.max_poll_s,
        help="cap on a phone's long poll (default %(default)g)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    """Gateway limits and timings from parsed ``flowerbed bridge`` arguments."""
    return GatewaySettings(
        max_upload_bytes=int(args.max_upload_mb * 2**20),
        chunk_bytes=args.chunk_kb * 1024,
        max_poll_s=args.max_poll_s,
        offline_after_s=args.offline_after_s,
        deadline_slack_s=args.deadline_slack_s,
        pull_interval_s=args.pull_interval_s,
    )


def run(args: argparse.Namespace) -> int:
    """Serve phones until SIGINT/SIGTERM; nodes are deactivated on the way out."""
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
    try:
        tokens = load_tokens(args.tokens)
        settings = settings_from_args(args)
    except (TokenFileError, ValueError) as err:
        log.error("%s", err)
        return 2
    connector = SuperLinkConnector(
        args.superlink,
        insecure=args.insecure,
        root_certificates=args.root_certificates,
        state_dir=args.state_dir,
    )
    gateway = Gateway(tokens, connector, settings)
    try:
        server = GatewayServer(
            gateway, args.host, args.port, args.certfile, args.keyfile
        )
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
        len(tokens),
        args.superlink,
        "insecure" if args.insecure else "TLS",
    )
    stop.wait()
    server.stop()
    return 0
