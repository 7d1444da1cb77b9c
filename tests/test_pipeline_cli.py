"""``flowerbed pipeline``: options become nodes and strategy settings; bad ones
are named before anything starts."""

from __future__ import annotations

import pytest
from flowerbed.cli import main
from flowerbed.sims import pipeline_cli
from flowerbed.sims.pipeline_local import device_gflops, reference_flops_per_sample


def parse(*argv: str) -> object:
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    pipeline_cli.register(sub)
    return parser.parse_args(["pipeline", *argv])


def test_devices_run_at_their_catalogue_rate() -> None:
    # A Pi 4B trains the reference LeNet-5 (4.16 MFLOP per sample) in 3.1 ms:
    # 1.35 GFLOP/s; "@2" halves it and a time scale of 4 quarters it again.
    assert reference_flops_per_sample() == pytest.approx(6 * 693_000)
    assert device_gflops("rpi4b") == pytest.approx(6 * 0.693 / 3.0815, rel=1e-3)
    assert device_gflops("rpi4b@2", time_scale=4) == pytest.approx(
        device_gflops("rpi4b") / 8
    )


def test_options_become_nodes_and_settings() -> None:
    args = parse(
        "--devices", "rpi5,rpi4b", "--crash", "1@7", "--slow", "0@4:3", "--even"
    )
    nodes, settings = pipeline_cli.build(args)  # type: ignore[arg-type]
    assert [n.device for n in nodes] == ["rpi5", "rpi4b"]
    assert nodes[1].crash_at_step == 7
    assert (nodes[0].slow_from_step, nodes[0].slow_factor) == (4, 3.0)
    assert settings["stage_sizes"] == [6, 5]  # vgg's 11 layers, equal counts
    assert settings["dataset"] == "digits32"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "rpi9"], "unknown device 'rpi9'; valid choices"),
        (["--crash", "5@3"], "DEVICE an index 0..2"),
        (["--slow", "0@4"], "expected DEVICE@STEP:FACTOR"),
        (["--devices", "rpi4b@0.5"], "factor after '@' must be >= 1"),
    ],
)
def test_bad_options_are_named_before_anything_runs(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["pipeline", *argv]) == 2
    assert message in capsys.readouterr().err
