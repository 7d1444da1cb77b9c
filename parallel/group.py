"""Joining a fresh gloo process group for one segment, and failing fast.

A gloo group cannot shrink (docs/references.md, "torch.distributed and gloo"), so
every segment (and every retry after a loss) starts a new group on a new
rendezvous port. Rank 0 hosts the rendezvous (a
``torch.distributed.TCPStore``) on its advertised address; every member binds
gloo to its own advertised address (so a board with several interfaces, or a
Debian host name resolving to 127.0.1.1, still works without
``GLOO_SOCKET_IFNAME``).

Two timeouts, both from the plan:

- ``join_timeout_s`` bounds the rendezvous: a member that never arrives (its board
  died before the segment, or its Flower message came late) makes the others
  raise :class:`PeerFailure` after this long;
- ``timeout_s`` bounds every collective and send/receive afterwards: a peer that
  dies mid-segment surfaces at once as "Connection closed by peer" on its
  neighbours (their processes then exit and close their own connections, so the
  failure cascades along the pipeline in milliseconds), and a peer that hangs
  surfaces after ``timeout_s``. (gloo takes every operation's timeout from
  ``init_process_group``'s, which also bounds its rendezvous, and ignores
  ``pg_options``' timeout; so the join is a barrier on the store first.)

:func:`joined_group` turns both into :class:`PeerFailure`; a rendezvous port that
is in use, or an advertised address that is not this board's, is a
:class:`RendezvousError` (the plan is wrong, no peer is lost).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from .plan import MemberPlan

log = logging.getLogger(__name__)

GLOO_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out",
    "timed out",
    "Broken pipe",
    "Connection refused",
    "Socket Timeout",
)
"""Substrings of gloo/c10d errors that mean a peer is gone or unresponsive."""
STORE_GRACE_S = 5.0
"""Seconds beyond the join timeout before a silent rendezvous counts as lost."""


class RendezvousError(RuntimeError):
    """The plan's rendezvous cannot be used here (port taken, foreign address)."""


class PeerFailure(RuntimeError):
    """A peer died or did not answer within the plan's timeout.

    ``phase`` says where it happened (``join``, ``setup``, ``train``,
    ``replicate`` ...), ``step`` the global step in progress (-1 if none).
    """

    def __init__(self, message: str, *, phase: str, step: int = -1) -> None:
        super().__init__(message)
        self.phase = phase
        self.step = step


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (tests, local runs)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def segment_port(first: int, count: int, segment: int) -> int:
    """The rendezvous port of ``segment``: round-robin over ``first .. first+count-1``.

    Consecutive segments use different ports, so a group that is still being torn
    down never collides with the next one. Deployment guides open this range.
    """
    if count < 1 or not 1 <= first <= 65535 - count + 1:
        raise ValueError(
            f"rendezvous ports {first}..{first + count - 1} are outside 1..65535"
        )
    return first + segment % count


def check_bindable(host: str, port: int) -> None:
    """Raise :class:`RendezvousError` unless this machine can listen on host:port.

    Tells a port in use apart from an address that is not one of this board's.
    """
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise RendezvousError(
                f"rendezvous port {port} on {host} is in use: another program (or "
                "a previous segment still closing) holds it; the server retries on "
                "the next port of its range"
            ) from err
        if err.errno == errno.EADDRNOTAVAIL:
            raise RendezvousError(
                f"advertised address {host} is not an address of this machine "
                f"({err.strerror}): set node_config 'address' to this board's IP "
                "on the network its peers share"
            ) from err
        raise RendezvousError(f"cannot listen on {host}:{port}: {err}") from err


def is_peer_failure(err: BaseException) -> bool:
    """Whether a torch.distributed error means a lost or unresponsive peer."""
    text = str(err)
    return any(marker in text for marker in GLOO_FAILURE_MARKERS)


@contextlib.contextmanager
def joined_group(plan: MemberPlan, address: str) -> Iterator[None]:
    """Join a fresh gloo group for ``plan`` as ``address``; leave it on exit.

    Inside the block, torch.distributed's default group is this segment's group.
    Errors from torch.distributed that mean a lost peer are re-raised as
    :class:`PeerFailure` with ``phase="train"`` unless a more specific
    :class:`PeerFailure` was raised inside.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed group is already active in this process"
        )
    if plan.rank == 0:
        check_bindable(plan.host, plan.port)
        if address != plan.host:
            raise RendezvousError(
                f"rank 0 advertises {address} but the plan's rendezvous host is "
                f"{plan.host}"
            )
    join = datetime.timedelta(seconds=plan.join_timeout_s)
    operation = datetime.timedelta(seconds=plan.timeout_s)
    started = time.monotonic()
    try:
        store = _connect_store(plan, join)
        # The join is a barrier on the store, bounded by the join timeout:
        # init_process_group's own timeout bounds both its rendezvous and every
        # later operation of the group (gloo ignores pg_options' timeout), so it
        # gets the operation timeout, and by then every member is there.
        store.set(f"flowerbed/arrived/{plan.rank}", "1")
        store.wait([f"flowerbed/arrived/{r}" for r in range(plan.world_size)], join)
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        options._timeout = operation
        dist.init_process_group(
            "gloo",
            store=store,
            rank=plan.rank,
            world_size=plan.world_size,
            timeout=operation,
            pg_options=options,
        )
    except PeerFailure:
        raise
    except RuntimeError as err:
        if "EADDRINUSE" in str(err) or "address already in use" in str(err):
            raise RendezvousError(
                f"rendezvous port {plan.port} on {plan.host} is in use"
            ) from err
        waited = time.monotonic() - started
        raise PeerFailure(
            f"could not join the group of {plan.world_size} at {plan.host}:{plan.port} "
            f"as rank {plan.rank} within {waited:.1f} s (join timeout "
            f"{plan.join_timeout_s:g} s): a member did not arrive ({_short(err)})",
            phase="join",
        ) from err
    try:
        yield
    except PeerFailure:
        raise
    except RuntimeError as err:
        if is_peer_failure(err):
            raise PeerFailure(
                f"rank {plan.rank} lost a peer: {_short(err)}", phase="train"
            ) from err
        raise
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        del store


def _connect_store(plan: MemberPlan, join: datetime.timedelta) -> Any:
    """The segment's TCPStore (rank 0 hosts it), or :class:`PeerFailure`.

    torch's client waits without bound when the port is held by a program that
    accepts connections but does not speak the store's protocol, so the connect
    runs in a daemon thread given ``join_timeout_s`` (plus a little) to finish.
    """
    import torch.distributed as dist

    found: dict[str, Any] = {}

    def connect() -> None:
        try:
            found["store"] = dist.TCPStore(
                plan.host,
                plan.port,
                plan.world_size,
                is_master=plan.rank == 0,
                timeout=join,
                wait_for_workers=False,
            )
        except BaseException as err:  # handed to the caller's thread
            found["error"] = err

    thread = threading.Thread(target=connect, name="span-rendezvous", daemon=True)
    thread.start()
    thread.join(plan.join_timeout_s + STORE_GRACE_S)
    if thread.is_alive():
        raise PeerFailure(
            f"the rendezvous at {plan.host}:{plan.port} did not answer within "
            f"{plan.join_timeout_s:g} s: rank 0 is not there, or another program "
            "holds that port",
            phase="join",
        )
    if "error" in found:
        raise found["error"]
    return found["store"]


def _short(err: BaseException) -> str:
    """The first line of a c10d error, without its C++ source location."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0][:300]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
