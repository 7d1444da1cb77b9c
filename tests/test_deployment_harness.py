"""The deployment harness (tests/procs.py) leaves no process behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from procs import Federation, alive, format_user_config, tagged

SUPEREXEC_STARTED = "Starting Flower SuperExec"


def test_node_config_is_written_in_flower_syntax() -> None:
    assert (
        format_user_config({"dataset-path": "/d/x.npz", "slowdown-s": 0.5, "n": 2})
        == 'dataset-path="/d/x.npz" slowdown-s=0.5 n=2'
    )
    assert format_user_config({"on": True}) == "on=true"
    with pytest.raises(ValueError, match="quotes/spaces"):
        format_user_config({"dataset-path": "/my data"})


@pytest.mark.slow
def test_every_process_is_stopped_when_the_test_body_fails(tmp_path: Path) -> None:
    tree: set[int] = set()
    with (
        pytest.raises(RuntimeError, match="test body failed"),
        Federation(tmp_path) as fed,
    ):
        link = fed.start_superlink()
        node = fed.add_supernode({"device": "x"})
        fed.wait_for_nodes([node])
        link.wait_for_log(SUPEREXEC_STARTED, timeout=60)
        node.wait_for_log(SUPEREXEC_STARTED, timeout=60)
        for proc in (link, node):
            family = set(tagged(proc.tag))
            assert proc.pid in family
            assert len(family) >= 2, f"{proc.name} should have started a SuperExec"
            tree |= family
        raise RuntimeError("test body failed")
    assert len(tree) >= 4
    assert not [pid for pid in tree if alive(pid)]
