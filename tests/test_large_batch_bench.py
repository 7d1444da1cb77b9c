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
    assert len(data["accuracy"]["runs"]) == 2
    text = "\n".join(section.render(data))
    assert "LargeBatchRounds (LAMB, warm-up 3)" in text


def test_an_unknown_part_is_named() -> None:
    with pytest.raises(ValueError, match="unknown large-batch part 'speed'"):
        section.check(argparse.Namespace(large_batch="scaling,speed"))
