"""Import paths that moved keep working for one release, with a warning."""

from __future__ import annotations

import pytest
from flowerbed import replies
from flowerbed.strategies import accumulation, checkpoints, staleness


def test_old_utils_names_still_resolve_with_a_deprecation_warning() -> None:
    from flowerbed.strategies import utils

    with pytest.warns(DeprecationWarning, match="moved to flowerbed.replies"):
        assert utils.ReplyRejected is replies.ReplyRejected
    with pytest.warns(DeprecationWarning, match="strategies.accumulation"):
        assert utils.UpdateAccumulator is accumulation.UpdateAccumulator
    with pytest.warns(DeprecationWarning):
        assert utils.load_checkpoint is checkpoints.load_checkpoint
    with pytest.warns(DeprecationWarning):
        assert utils.STALENESS_FUNCTIONS is staleness.STALENESS_FUNCTIONS


def test_an_unknown_name_is_an_attribute_error() -> None:
    from flowerbed.strategies import utils

    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        _ = utils.nonsense


def test_cluster_selection_training_imports_as_selector_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from flowerbed.strategies.cluster_selection import selector

    old = "flowerbed.strategies.cluster_selection.training"
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match="cluster_selection.selector"):
        from flowerbed.strategies.cluster_selection.training import SelectedGrid
    assert SelectedGrid is selector.SelectedGrid
