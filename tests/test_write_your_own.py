"""The worked examples of docs/strategies/write-your-own.md run as written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

PAGE = Path(__file__).parents[1] / "docs" / "strategies" / "write-your-own.md"


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)


@pytest.fixture(scope="module")
def page() -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    for snippet in snippets()[:2]:  # the two strategies
        exec(compile(snippet, str(PAGE), "exec"), namespace)
    return namespace


def test_the_decay_recipe_halves_the_rate_every_five_rounds(
    page: dict[str, Any],
) -> None:
    from flwr.app import ConfigRecord
    from test_strategies_fakes import FakeGrid, node, weights

    strategy = page["DecayingDeadlineFedAvg"](fraction_evaluate=0.0)
    rates = []
    for server_round in (1, 5, 6, 11):
        config = ConfigRecord()
        messages = list(
            strategy.configure_train(
                server_round, weights(), config, FakeGrid({1: node(1.0, seconds=1)})
            )
        )
        rates.append(messages[0].content["config"]["lr"])
    assert rates == [0.05, 0.05, 0.025, 0.0125]


def test_until_target_stops_the_run_at_the_target(page: dict[str, Any]) -> None:
    namespace = dict(page)
    exec(compile(snippets()[2], str(PAGE), "exec"), namespace)
    outcome = namespace["outcome"]
    accuracies = [r.accuracy for r in outcome.records]
    assert accuracies[-1] >= 0.85
    assert all(a < 0.85 for a in accuracies[:-1])
    assert len(accuracies) < 30


def test_a_declared_option_is_adopted_shown_and_checked() -> None:
    import inspect

    from flwr.app import ConfigRecord
    from test_strategies_fakes import FakeGrid, node, weights

    namespace: dict[str, Any] = {}
    exec(compile(snippets()[3], str(PAGE), "exec"), namespace)
    strategy_class, warmup = namespace["WarmupDeadlineFedAvg"], namespace["Warmup"]
    strategy = strategy_class(fraction_evaluate=0.0, warmup=warmup(warmup_rounds=3))
    assert strategy.warmup_rounds == 3 and strategy.fraction_evaluate == 0.0
    rates = []
    for server_round in (1, 2, 3, 4):
        messages = list(
            strategy.configure_train(
                server_round,
                weights(),
                ConfigRecord(),
                FakeGrid({1: node(1.0, seconds=1)}),
            )
        )
        rates.append(messages[0].content["config"]["lr"])
    assert rates == pytest.approx([0.05 / 3, 0.1 / 3, 0.05, 0.05])
    assert inspect.signature(strategy_class).parameters["warmup"].default == warmup()
    with pytest.raises(TypeError, match=r"wramup; valid: .*warmup"):
        strategy_class(wramup=warmup())
