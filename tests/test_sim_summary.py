"""What ``flowerbed sim`` prints reads right: failures grouped with unambiguous
counts and Flower's node ids, lines in the order things happened, a table that
fits 80 columns, and no Flower warning about settings flowerbed chose."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import pytest
from flowerbed import keys
from flowerbed.cli import main
from flowerbed.data import load_dataset
from flowerbed.models import build_model
from flowerbed.sims.recorder import RoundRecord, RunRecorder
from flowerbed.sims.scenario import build_fleet_grid, run_scenario
from flowerbed.sims.summary import COLUMNS, failure_lines, round_row, round_table, spans
from flwr.app import ArrayRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp.strategy import FedAvg
from rich.console import Console

TTL_ERROR = "no reply within the message's TTL of 3600 s"


@pytest.fixture
def recorder() -> RunRecorder:
    grid = build_fleet_grid({"num-nodes": 2})  # also gives messages a task identity
    return RunRecorder(grid, "lenet", load_dataset("digits", ""))


def task(recorder: RunRecorder, node: int, reason: str | None) -> None:
    """A train task sent to ``node`` that fails with ``reason`` (None: succeeds,
    reporting partition ``node - 1000``)."""
    message = Message(RecordDict(), node, "train", ttl=3600.0, group_id="1")
    message_id = f"task-{id(message)}"
    message.metadata.__dict__["_message_id"] = message_id
    recorder.sent(message_id, message)
    if reason is None:
        metrics = MetricRecord({keys.PARTITION_ID: node - 1000})
        reply = Message(RecordDict({keys.METRICS: metrics}), reply_to=message)
    else:
        code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
        reply = Message(Error(code, reason), reply_to=message)
    recorder.received(reply)


def close_round(recorder: RunRecorder, server_round: int) -> None:
    arrays = ArrayRecord(build_model("lenet", 1, 8, 10).state_dict())
    recorder.evaluate_fn(server_round, arrays)


def test_failures_are_grouped_by_kind_with_counts_nodes_rounds_and_the_first(
    recorder: RunRecorder,
) -> None:
    task(recorder, 1003, "rpi3b (partition 3) dropped out")
    task(recorder, 1017, "low-end-phone (partition 17) dropped out")
    task(recorder, 1004, None)
    close_round(recorder, 1)
    task(recorder, 1003, "rpi3b (partition 3) dropped out")
    task(recorder, 1005, "rpi3b (partition 5) dropped out")
    close_round(recorder, 2)
    task(recorder, 1003, TTL_ERROR)
    close_round(recorder, 3)

    # failed: the node ids the strategy sent to; participants: partition ids
    assert [r.failed for r in recorder.records] == [[1003, 1017], [1003, 1005], [1003]]
    assert [r.participants for r in recorder.records] == [[4], [], []]
    summary = recorder.error_summary()
    assert summary[0] == {
        "kind": "rpi3b (partition #) dropped out",
        "count": 3,
        "nodes": {"1003": 2, "1005": 1},
        "rounds": [1, 2],
        "example": {
            "node": 1003,
            "round": 1,
            "reason": "rpi3b (partition 3) dropped out",
        },
    }
    assert [e["count"] for e in summary] == [3, 1, 1]  # most tasks, then first seen
    results = {"failed_tasks": 5, "trained_tasks": 1, "errors": summary}
    assert failure_lines(results) == [
        "5 of 6 train tasks failed:",
        "  3 tasks on 2 nodes (1003, 1005) in rounds 1-2; the first:",
        "    node 1003 in round 1: rpi3b (partition 3) dropped out",
        "  node 1017 in round 1: low-end-phone (partition 17) dropped out",
        f"  node 1003 in round 3: {TTL_ERROR}",
    ]


def test_a_summary_names_five_nodes_and_counts_the_rest() -> None:
    error = {
        "count": 9,
        "nodes": {str(n): 1 for n in range(1001, 1010)},
        "rounds": [2, 3, 4, 7],
        "example": {"node": 1001, "round": 2, "reason": "rpi5 (partition 1) ..."},
    }
    results = {"failed_tasks": 9, "trained_tasks": 0, "errors": [error]}
    assert failure_lines(results)[1] == (
        "  9 tasks on 9 nodes (1001, 1002, 1003, 1004, 1005 and 4 more) in rounds "
        "2-4 and 7; the first:"
    )
    assert spans([5, 1, 2, 3, 7, 9, 10]) == "1-3, 5, 7 and 9-10"
    assert failure_lines({"failed_tasks": 0, "trained_tasks": 3, "errors": []}) == []


def flower_lines(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage().strip() for r in records if r.name == "flwr"]


def failures_by_round(log: str) -> dict[int, list[int]]:
    """Node ids of the failures a run's log names, by the round whose block
    (from "[ROUND r/n]" to its "Global evaluation") names them; fails on a
    failure or a dropout named outside its round's block."""
    said: dict[int, list[int]] = {}
    current = 0
    for line in log.splitlines():
        if found := re.search(r"\[ROUND (\d+)/", line):
            current = int(found.group(1))
        elif line.rstrip().endswith("Global evaluation"):
            said.setdefault(current, [])
            current = 0
        elif found := re.search(r"Received error in reply from node (\d+): ", line):
            assert current, f"{line!r} outside its round's block"
            said.setdefault(current, []).append(int(found.group(1)))
        elif "dropped out" in line:  # said by anyone else, e.g. a node
            assert current, f"{line!r} outside its round's block"
    return {r: sorted(ids) for r, ids in said.items()}


def test_flowers_log_tells_each_failure_in_its_round_by_the_summarys_node_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="flwr")
    run = {"num-nodes": 6, "num-rounds": 3, "dropout": 0.3, "seed": 1}
    outcome = run_scenario(run, write=False)
    said = failures_by_round("\n".join(flower_lines(caplog.records)))
    failed = {r.round: r.failed for r in outcome.records}
    assert said == failed
    assert any(failed.values())  # the seed fails some tasks
    named = {int(n) for e in outcome.results["errors"] for n in e["nodes"]}
    assert named == {n for ids in failed.values() for n in ids}


def test_the_round_table_fits_80_columns_with_every_header_whole() -> None:
    table = round_table("deadline on phones-10x")
    big = RoundRecord(
        1000, 3_600_000.0, 1.0, 0.1, list(range(9999)), list(range(9999)), 9999,
        123_456.7, 1.0,
    )  # fmt: skip
    table.add_row(*round_row(big))
    console = Console(width=80, file=io.StringIO(), record=True)
    console.print(table)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    header = next(line for line in text.splitlines() if "round" in line and "┃" in line)
    assert [cell.strip() for cell in header.strip("┃").split("┃")] == list(COLUMNS)
    assert "stragglers: tasks still out when the" in " ".join(text.split())


def test_sim_shows_no_flower_warning_about_the_settings_it_chose(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="flwr")
    assert main(["sim", "--nodes", "2", "--rounds", "1", "--out", str(tmp_path)]) == 0
    assert flower_lines(caplog.records) == []  # no warning, and INFO only with -v
    caplog.clear()
    caplog.set_level(logging.INFO, logger="flwr")
    FedAvg(fraction_evaluate=0.0)  # a user's own strategy still gets the warning
    assert flower_lines(caplog.records) == [
        "fraction_evaluate is set to 0.0. Federated evaluation will be skipped."
    ]


@pytest.mark.slow
def test_flwr_run_logs_each_failure_in_its_round_and_no_settings_warning(
    tmp_path: Path,
) -> None:
    import json

    from procs import Federation

    out = tmp_path / "runs"
    config = {"num-nodes": 8, "num-rounds": 3, "dropout": 0.3, "seed": 3}
    with Federation(tmp_path / "fed") as fed:
        fed.start_superlink(simulated_supernodes=8)
        run = fed.run(
            Path(__file__).parents[1],
            {**config, "local-steps": 3, "output-dir": str(out)},
            timeout=600,
        )
    assert run.status == "finished:completed", run.log[-3000:]
    assert "fraction_evaluate" not in run.log
    [folder] = out.iterdir()
    results = json.loads((folder / "results.json").read_text())
    failed = {r["round"]: r["failed"] for r in results["rounds"]}
    assert failures_by_round(run.log) == failed
    assert any(failed.values())  # the seed fails some tasks


def test_only_the_notice_of_flowerbeds_setting_is_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from flowerbed.sims.notices import our_settings

    caplog.set_level(logging.INFO, logger="flwr")
    with our_settings():
        FedAvg(fraction_evaluate=0.0)
        FedAvg(fraction_train=0.0)  # not a setting flowerbed chose: still said
    assert flower_lines(caplog.records) == [
        "fraction_train is set to 0.0. Federated training will be skipped."
    ]
