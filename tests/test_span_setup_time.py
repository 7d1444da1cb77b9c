"""A span member's set-up times: the ClientApp's start, the rendezvous, the rest."""

from __future__ import annotations

import sys
import time

import pytest
from flowerbed import keys
from flowerbed.parallel.setup_time import (
    SPAN_JOIN_S,
    SPAN_START_S,
    SetupClock,
    member_setup_s,
    process_age_s,
)
from fresh import python_prints


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_process_age_counts_from_the_process_start_not_from_the_call() -> None:
    # A child that sleeps 0.5 s before asking: its age covers the sleep (and
    # its interpreter's start), to /proc's 10 ms resolution.
    code = (
        "import time; time.sleep(0.5)\n"
        "from flowerbed.parallel.setup_time import process_age_s\n"
        "print(process_age_s())"
    )
    began = time.monotonic()
    age = float(python_prints(code).strip())
    wall = time.monotonic() - began
    assert 0.5 - 0.02 <= age <= wall + 0.02


def test_process_age_of_this_process_grows() -> None:
    first = process_age_s()
    time.sleep(0.05)
    assert process_age_s() >= first


def test_clock_reports_start_join_and_setup() -> None:
    clock = SetupClock(arrived=time.monotonic() - 3.0, start_s=4.0)
    clock.joined(1.5)
    setup = clock.ready()
    assert 3.0 <= setup < 3.5
    metrics = clock.metrics()
    assert metrics[SPAN_START_S] == 4.0
    assert metrics[SPAN_JOIN_S] == 1.5
    assert metrics[keys.SPAN_SETUP_S] == setup
    text = clock.describe()
    assert text.startswith(f"set-up {4.0 + setup:.1f} s: ClientApp start 4.0 s")
    assert "rendezvous 1.5 s" in text


def test_member_setup_is_start_plus_setup_and_ignores_what_is_missing() -> None:
    assert member_setup_s({SPAN_START_S: 5.0, keys.SPAN_SETUP_S: 2.5}) == 7.5
    assert member_setup_s({keys.SPAN_SETUP_S: 2.5}) == 2.5
    assert member_setup_s({SPAN_START_S: True, keys.SPAN_SETUP_S: "x"}) == 0.0
