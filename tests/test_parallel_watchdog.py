"""A span ClientApp whose SuperNode is gone ends itself (parallel/watchdog.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest
from flowerbed.parallel.watchdog import (
    WATCHDOG_EXIT_CODE,
    runtime_api_address,
    split_address,
)


def test_the_supernode_address_comes_from_flwr_clientapps_command_line() -> None:
    argv = ["flwr-clientapp", "--runtime-api-address", "127.0.0.1:9094", "--insecure"]
    assert runtime_api_address(argv) == "127.0.0.1:9094"
    assert runtime_api_address(["x", "--runtime-api-address=[::1]:7"]) == "[::1]:7"
    assert runtime_api_address(["python", "-m", "pytest"]) is None


def test_a_wildcard_host_is_reached_on_the_loopback_address() -> None:
    assert split_address("0.0.0.0:9094") == ("127.0.0.1", 9094)
    assert split_address("[::]:9094") == ("::1", 9094)
    assert split_address("[::1]:7") == ("::1", 7)
    assert split_address("10.0.0.2:9094") == ("10.0.0.2", 9094)


WATCHED = """
import sys, time
sys.argv = ["flwr-clientapp", "--runtime-api-address", "127.0.0.1:{port}"]
from flowerbed.parallel.watchdog import start_supernode_watchdog
assert start_supernode_watchdog()
print("watching", flush=True)
time.sleep(120)  # a segment that would train on
"""


@pytest.mark.slow
def test_a_member_ends_itself_soon_after_its_supernode_stops_answering() -> None:
    supernode = socket.create_server(("127.0.0.1", 0))
    port = supernode.getsockname()[1]
    member = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WATCHED.format(port=port))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert member.stdout is not None
        assert member.stdout.readline().strip() == "watching"
        assert member.poll() is None  # the SuperNode answers: it trains on
        supernode.close()  # the SuperNode dies
        gone = time.monotonic()
        code = member.wait(timeout=30)
        seconds = time.monotonic() - gone
    finally:
        if member.poll() is None:
            member.kill()
            member.wait()
    _, err = member.communicate()
    assert code == WATCHDOG_EXIT_CODE, err
    assert "SuperNode is gone" in err
    # two misses 0.5 s apart; generous for a busy machine
    assert seconds < 10, seconds
