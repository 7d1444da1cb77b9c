"""The large-batch bench section runs at toy size and renders its tables."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from flowerbed.bench import large_batch_section as section
from flowerbed.bench.sections import SectionRun


def ctx(tmp_path: Path, parts: str) -> SectionRun:
    args = argparse.Namespace(quick=True, large_batch=parts)
    return SectionRun("large-batch", args, tmp_path)


def test_scaling_table_shows_wired_scaling_and_wifi_flattening(tmp_path: Path) -> None:
    data = section.run(ctx(tmp_path, "scaling"))
    rows = {(r["model"], r["network"], r["phones"]): r for r in data["scaling"]["rows"]}
    assert rows[("resnet-50", "wired", 138)]["efficiency"] > 0.9
    assert rows[("resnet-50", "wifi", 138)]["efficiency"] < 0.35
    for row in rows.values():  # the bandwidth term alone never exceeds the model
        assert row["bound-s"] <= row["allreduce-s"] + 1e-12
        assert row["limit-samples-per-s"] >= row["samples-per-s"]
    text = "\n".join(section.render(data))
    assert "## Large-batch synchronous training (S1)" in text
    assert "| resnet-50 | 102.40 | wired | 138 |" in text
    assert "Caffe" in text  # the GPU reference names its framework


@pytest.mark.slow
def test_engine_parts_run_at_toy_size(tmp_path: Path) -> None:
    data = section.run(ctx(tmp_path, "rounds,accuracy"))
    assert [r["network"] for r in data["rounds"]["rows"]] == ["wired", "wifi"]
    wired, wifi = data["rounds"]["rows"]
    assert wifi["virtual-s-per-round"] > wired["virtual-s-per-round"]
    runs = [r["strategy"] for r in data["accuracy"]["runs"]]
    assert runs == [
        "LargeBatchRounds (LAMB, warm-up 3)",
        "Flower FedAvg, 1 step(s) of 4, lr 0.03",
        "Flower FedAvg, 4 step(s) of 1, lr 0.01",
    ]
    text = "\n".join(section.render(data))
    assert "| LargeBatchRounds (LAMB, warm-up 3) | 1 |" in text


def test_accuracy_rows_show_the_mean_and_spread_over_seeds() -> None:
    def run(name: str, seed: int, final: float, reached: float | None) -> dict:
        return {
            "strategy": name,
            "seed": seed,
            "final-accuracy": final,
            "best-accuracy": final,
            "time-to-target-s": reached,
            "virtual-s": 6.0,
            "wall-s": 10.0,
        }

    data = {
        "accuracy": {
            "phones": 138,
            "rounds": 30,
            "target": 0.8,
            "seeds": [1, 2],
            "runs": [
                run("LB", 1, 0.90, 3.0),
                run("FedAvg", 1, 0.70, None),
                run("LB", 2, 0.95, 2.0),
                run("FedAvg", 2, 0.82, 5.0),
            ],
            "sweep": [run("Flower FedAvg, lr 0.1", 1, 0.70, None)],
        }
    }
    text = "\n".join(section.render(data))
    assert (
        "| LB | 2 | 0.925 [0.900, 0.950] | 0.925 [0.900, 0.950] | 2.5 [2, 3] |" in text
    )
    assert (
        "| FedAvg | 2 | 0.760 [0.700, 0.820] | 0.760 [0.700, 0.820] "
        "| 5 (reached on 1 of 2 seeds) |" in text
    )
    assert "FedAvg sweep (seed 1, final accuracy): lr 0.1: 0.700." in text
    # Issue 12's target: large batches lose at most one point against FedAvg.
    assert "LB 0.925 vs FedAvg 0.760 (mean over seeds), +16.5 points (met)." in text
    data["accuracy"]["runs"][0]["final-accuracy"] = 0.60  # LB mean 0.775: +1.5
    assert "+16.5" not in "\n".join(section.render(data))
    data["accuracy"]["runs"][2]["final-accuracy"] = 0.70  # LB mean 0.650: -11
    assert "-11.0 points (**not met**)." in "\n".join(section.render(data))
    # A part from a run that did not record its date says so; a new one its date.
    assert "Measured by an earlier run than the one named at the top" in text
    data["accuracy"]["measured"] = "2026-11-27T09:00:00+00:00"
    data["accuracy"]["load_average"] = [0.5, 0.25, 0.125]
    assert (
        "Part measured 2026-11-27T09:00:00+00:00 (UTC), load average at the start "
        "of the part 0.50 / 0.25 / 0.12 (1/5/15 min)."
    ) in "\n".join(section.render(data))


def test_an_unknown_part_is_named() -> None:
    with pytest.raises(ValueError, match="unknown large-batch part 'speed'"):
        section.check(argparse.Namespace(large_batch="scaling,speed"))
