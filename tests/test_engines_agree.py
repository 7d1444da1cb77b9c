"""The in-process engine and Flower's simulation engine (Ray) agree for a seed.

The same scenario runs twice: once with ``flwr run`` against a real
``flower-superlink --simulation`` (Flower's Ray engine, its own node ids and reply
order), once on ``FleetGrid``. Nodes draw their device, data and dropouts from
(seed, partition-id, round), so each round must have the same participants, and the
final accuracies must be within one point (aggregation order differs, so floating
point sums may differ in the last bits).
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


@pytest.mark.slow
def test_same_participants_and_accuracy_on_both_engines(tmp_path: Path) -> None:
    ray_out = tmp_path / "ray-runs"
    with Federation(tmp_path / "ray") as fed:
        fed.start_superlink(simulated_supernodes=SCENARIO["num-nodes"])
        run = fed.run(ROOT, {**SCENARIO, "output-dir": str(ray_out)}, timeout=600)
        assert run.status == "finished:completed", run.log[-3000:]
    [ray_dir] = ray_out.iterdir()
    ray = json.loads((ray_dir / "results.json").read_text())

    local = run_scenario(SCENARIO, write=False).results

    assert ray["engine"] == "flower-simulation" and local["engine"] == "in-process"
    ray_rounds = [r["participants"] for r in ray["rounds"]]
    assert ray_rounds == [r["participants"] for r in local["rounds"]]
    assert any(len(p) < SCENARIO["num-nodes"] for p in ray_rounds)  # dropouts happened
    assert abs(ray["final_accuracy"] - local["final_accuracy"]) <= 0.01
