"""The in-process engine and Flower's simulation engine (Ray) agree for a seed.

The same scenario runs twice per strategy: once with ``flwr run`` against a real
``flower-superlink --simulation`` (Flower's Ray engine, its own node ids and reply
order, behind :class:`~flowerbed.sims.virtual_grid.VirtualTimeGrid`), once on
``FleetGrid``. Nodes draw their device, data and dropouts from (seed, partition-id,
round), and both engines release replies in virtual-time order, so each round must
have the same participants at the same virtual time -- for FedAvg, and for the
strategies whose rounds depend on reply order and timing (DeadlineFedAvg's deadline
and first-K, FedBuff's buffer) -- and the final accuracies must be within one point
(Ray trains node by node, the in-process engine batched; sums differ in the last
bits).
"""

import json
from pathlib import Path

import pytest
from flowerbed.sims.scenario import run_scenario
from procs import Federation

ROOT = Path(__file__).parents[1]
SCENARIO = {
    "fleet": "mixed",
    "num-nodes": 6,
    "num-rounds": 3,
    "dropout": 0.25,
    "seed": 5,
    "local-steps": 5,
}


STRATEGIES = ("fedavg", "deadline", "fedbuff")


@pytest.mark.slow
def test_same_participants_rounds_and_accuracy_on_both_engines(
    tmp_path: Path,
) -> None:
    ray: dict[str, dict] = {}
    with Federation(tmp_path / "ray") as fed:
        fed.start_superlink(simulated_supernodes=SCENARIO["num-nodes"])
        for strategy in STRATEGIES:
            out = tmp_path / f"ray-{strategy}"
            config = {**SCENARIO, "strategy": strategy, "output-dir": str(out)}
            run = fed.run(ROOT, config, timeout=600)
            assert run.status == "finished:completed", run.log[-3000:]
            [run_dir] = out.iterdir()
            ray[strategy] = json.loads((run_dir / "results.json").read_text())

    for strategy in STRATEGIES:
        local = run_scenario({**SCENARIO, "strategy": strategy}, write=False).results
        remote = ray[strategy]
        assert remote["engine"] == "flower-simulation"
        assert local["engine"] == "in-process"
        rounds = [(r["participants"], r["virtual_time_s"]) for r in remote["rounds"]]
        assert rounds == [
            (r["participants"], r["virtual_time_s"]) for r in local["rounds"]
        ], strategy
        assert abs(remote["final_accuracy"] - local["final_accuracy"]) <= 0.01
    # the seed drops nodes: the engines agree on who vanished and when
    assert any(
        len(r["participants"]) < SCENARIO["num-nodes"] for r in ray["fedavg"]["rounds"]
    )
