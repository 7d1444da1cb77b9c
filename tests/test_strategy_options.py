"""The strategies' option objects, and the flat keywords they replace."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
from flowerbed.strategies import (
    DeadlineFedAvg,
    FedBuff,
    LargeBatchRounds,
    RuntimeWeightedFedAvg,
)
from flowerbed.strategies.large_batch_rounds import LargeBatchRecipe
from flowerbed.strategies.options import (
    Buffering,
    Deadlines,
    Robustness,
    Staleness,
    WorkBalance,
)
from flwr.serverapp.strategy import FedAvg


def test_option_objects_set_what_the_strategy_reads() -> None:
    strategy = DeadlineFedAvg(
        0.5,
        fraction_evaluate=0.0,
        work=WorkBalance(balance_work=True, local_steps=20),
        robustness=Robustness(weight_cap=3.0),
        deadlines=Deadlines(deadline_s=5.0, partial_work=True),
        staleness=Staleness(max_staleness=4),
    )
    assert strategy.fraction_train == 0.5 and strategy.fraction_evaluate == 0.0
    assert (strategy.balance_work, strategy.local_steps) == (True, 20)
    assert (strategy.weight_cap, strategy.clip_factor) == (3.0, 3.0)
    assert (strategy.deadline_s, strategy.partial_work) == (5.0, True)
    assert strategy.max_staleness == 4
    assert strategy.deadline_percentile is None  # two speeds with partial work
    assert strategy.deadlines.deadline_s == 5.0


def test_each_strategy_has_its_own_defaults() -> None:
    assert RuntimeWeightedFedAvg().weighting == "fednova"
    fedbuff = FedBuff()
    assert (fedbuff.weighting, fedbuff.max_staleness) == ("examples", 10)
    assert DeadlineFedAvg().max_staleness == 2
    rounds = LargeBatchRounds()
    assert (rounds.weighting, rounds.local_steps, rounds.late_updates) == (
        "examples",
        1,
        False,
    )
    assert rounds.batch_size == 256


def test_flat_keywords_still_work_and_name_the_object_to_use() -> None:
    with pytest.warns(DeprecationWarning) as caught:
        strategy = DeadlineFedAvg(deadline_s=5.0, weight_cap=3.0)
    messages = [str(w.message) for w in caught]
    assert any("pass deadlines=Deadlines(deadline_s=5.0)" in m for m in messages)
    assert any("pass robustness=Robustness(weight_cap=3.0)" in m for m in messages)
    assert (strategy.deadline_s, strategy.weight_cap) == (5.0, 3.0)
    assert all(w.filename == __file__ for w in caught)  # the caller's line


def test_an_object_and_one_of_its_fields_together_are_refused() -> None:
    with pytest.raises(TypeError, match="put them in the Robustness"):
        RuntimeWeightedFedAvg(robustness=Robustness(), weight_cap=3.0)


@dataclass(frozen=True)
class Tempo:
    beat_s: float = 1.0


class TempoFedAvg(DeadlineFedAvg):
    OPTION_DEFAULTS: ClassVar[Mapping[str, Any]] = {
        "tempo": Tempo(),
        "staleness": Staleness(max_staleness=5),
    }
    tempo: Tempo
    beat_s: float


def test_a_subclass_declares_its_options_and_the_base_constructor_adopts_them() -> None:
    strategy = TempoFedAvg(0.5, 0.25, 3, tempo=Tempo(beat_s=2.0))
    assert (strategy.fraction_train, strategy.fraction_evaluate) == (0.5, 0.25)
    assert strategy.min_train_nodes == 3  # Flower's arguments keep their places
    assert (strategy.tempo, strategy.beat_s) == (Tempo(beat_s=2.0), 2.0)
    assert strategy.max_staleness == 5  # the base's option, this class's default
    assert strategy.deadlines == Deadlines()
    with pytest.warns(DeprecationWarning, match=r"pass tempo=Tempo\(beat_s=3.0\)"):
        assert TempoFedAvg(beat_s=3.0).tempo == Tempo(beat_s=3.0)
    with pytest.raises(TypeError, match=r"tmepo; valid: .*tempo"):
        TempoFedAvg(tmepo=Tempo())


def test_the_signature_shows_flower_s_arguments_then_the_options() -> None:
    # The constructors take (*args, **kwargs); help() and inspect still show
    # what they accept: FedAvg's ten arguments in Flower's order, the keyword-only
    # arguments of the constructors, and each option with its default object.
    flower = list(inspect.signature(FedAvg).parameters)
    for strategy in (RuntimeWeightedFedAvg, DeadlineFedAvg, FedBuff, TempoFedAvg):
        params = inspect.signature(strategy).parameters
        assert list(params)[: len(flower)] == flower
        assert params["seed"].kind is inspect.Parameter.KEYWORD_ONLY
        assert params["robustness"].default == Robustness()
    assert inspect.signature(DeadlineFedAvg).parameters["deadlines"].default == (
        Deadlines()
    )
    assert "deadlines" not in inspect.signature(FedBuff).parameters
    assert inspect.signature(TempoFedAvg).parameters["tempo"].default == Tempo()

    class Named(DeadlineFedAvg):  # a user's constructor that names its arguments
        def __init__(self, cohort: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.cohort = cohort

    assert list(inspect.signature(Named).parameters) == ["cohort", "kwargs"]


def test_an_unknown_keyword_is_refused_with_the_valid_ones() -> None:
    with pytest.raises(TypeError, match=r"wieght_cap; valid: .*robustness"):
        FedBuff(wieght_cap=3.0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: WorkBalance(weighting="speed"), "valid: runtime, throughput"),
        (lambda: Robustness(weight_cap=0.5), "weight_cap must be >= 1"),
        (lambda: Robustness(clip_factor=float("nan")), "clip_factor must be finite"),
        (lambda: Deadlines(deadline_s=-1.0), "Deadlines: deadline_s must be > 0"),
        (lambda: Staleness(max_staleness=-1), "max_staleness must be >= 0"),
        (lambda: Buffering(buffer_size=0), "buffer_size must be >= 1"),
        (lambda: LargeBatchRecipe(optimizer="adam"), "valid choices: sgd"),
    ],
)
def test_options_check_their_values(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]


def test_both_large_batch_recipes_share_one_keyword_only_server_optimiser() -> None:
    from flowerbed.strategies.large_batch_options import (
        AllReduceRecipe,
        ServerOptimiser,
    )

    rounds, sync = LargeBatchRecipe(512, optimizer="sgd"), AllReduceRecipe("fp16")
    assert isinstance(rounds, ServerOptimiser) and isinstance(sync, ServerOptimiser)
    assert (rounds.batch_size, rounds.optimizer, sync.compression) == (
        512,
        "sgd",
        "fp16",
    )
    assert rounds.schedule().batch_size == 512 and sync.schedule(64).batch_size == 64
    with pytest.raises(ValueError, match="compression 'lamb'"):
        AllReduceRecipe("lamb")  # the optimiser is keyword-only


def test_large_batch_rounds_keeps_example_weighting() -> None:
    with pytest.raises(ValueError, match="weighted by examples"):
        LargeBatchRounds(work=WorkBalance(weighting="runtime"))
    recipe = LargeBatchRecipe(batch_size=512, optimizer="lamb")
    rounds = LargeBatchRounds(recipe=recipe)
    assert rounds.batch_size == 512 and rounds.server_optimizer.kind == "lamb"


def test_the_hardened_bound_caps_a_replys_pull_not_weight_and_length_apart() -> None:
    # References: weights [1, 1, 1], norms [1, 1, 1]. A reply of weight 2 and
    # update +10: the default counts it as weight 2, length 3 (pull 6); the
    # hardened bound as weight 2, length 1.5 x 1/2 = 0.75 (pull 1.5).
    import numpy as np
    from flowerbed.strategies.robust import BoundedSum, Reference

    base = {"w": np.zeros(1, np.float32)}
    for pull_bound, clip, length in ((False, 3.0, 3.0), (True, 1.5, 0.75)):
        total = BoundedSum(
            2.0, clip, Reference([1, 1, 1]), Reference([1, 1, 1]), pull_bound=pull_bound
        )
        total.add({"w": np.array([10.0], np.float32)}, base, 2.0)
        assert float(total.result(base)["w"][0]) == pytest.approx(length)
    hardened = Robustness.hardened()
    assert (hardened.pull_bound, hardened.clip_factor, hardened.weight_cap) == (
        True,
        1.5,
        2.0,
    )
