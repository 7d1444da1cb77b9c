"""Scale: 100 simulated phones on one gateway; its memory per phone is measured."""

from __future__ import annotations

import re

import pytest
from flowerbed.clients.bridge.scale import measure_memory_per_phone


@pytest.mark.slow
def test_memory_per_phone_is_measured_with_100_connected_phones(tmp_path):
    report = measure_memory_per_phone(100, workdir=tmp_path)
    log = (tmp_path / "gateway.log").read_text()
    online = set(re.findall(r"phone (\S+): node \d+ online", log))
    assert online == {f"phone{i}" for i in range(100)}
    assert report.phones == 100
    assert report.loaded_bytes > report.baseline_bytes > 0
    growth = report.loaded_bytes - report.baseline_bytes
    assert report.per_phone_bytes == pytest.approx(growth / 100)
