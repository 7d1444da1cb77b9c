"""The strategy docs: one page per strategy, and their snippets run as written."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from flowerbed import strategies
from flowerbed.strategies.options import option_defaults
from flwr.serverapp import ServerApp

DOCS = Path(__file__).parents[1] / "docs" / "strategies"
PAGES = {
    "RuntimeWeightedFedAvg": "runtime-weighted.md",
    "DeadlineFedAvg": "deadline.md",
    "FedBuff": "fedbuff.md",
    "ClusterSelection": "cluster-selection.md",
    "LargeBatchSync": "large-batch-sync.md",
    "LargeBatchRounds": "large-batch-rounds.md",
    "TiledTraining": "tiled.md",
    "PipelineTraining": "pipeline.md",
}


WRAPPERS = {
    "DifferentialPrivacyClientSideAdaptiveClipping",
    "DifferentialPrivacyClientSideFixedClipping",
    "DifferentialPrivacyServerSideAdaptiveClipping",
    "DifferentialPrivacyServerSideFixedClipping",
}
"""Flower's DP wrappers, re-exported: one page for the four."""


def test_every_exported_strategy_has_a_page_listed_in_the_index() -> None:
    assert set(PAGES) | WRAPPERS == set(strategies.__all__)
    index = (DOCS / "index.md").read_text()
    for page in PAGES.values():
        assert f"({page})" in index
    assert "(differential-privacy.md)" in index
    wrappers_page = (DOCS / "differential-privacy.md").read_text()
    for name in WRAPPERS:
        assert f"`{name}`" in wrappers_page


def table_parameters(page: str) -> set[str]:
    text = (DOCS / page).read_text()
    return set(re.findall(r"^\| `(\w+)` \|", text, flags=re.MULTILINE))


@pytest.mark.parametrize("name", sorted(PAGES))
def test_page_documents_every_parameter_with_its_default(name: str) -> None:
    cls = getattr(strategies, name)
    own = {
        p.name
        for p in inspect.signature(cls).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    } | set(option_defaults(cls))
    # A page documents its own parameters and links its base's page for the rest.
    documented = set().union(
        *(
            table_parameters(PAGES[c.__name__])
            for c in cls.__mro__
            if c.__name__ in PAGES
        )
    )
    assert own - documented == set()
    for base in cls.__mro__[1:]:
        if base.__name__ in PAGES:
            assert (
                f"({PAGES[base.__name__]}#parameters)"
                in (DOCS / PAGES[name]).read_text()
            )


@pytest.mark.parametrize("name", sorted(PAGES))
def test_snippet_builds_a_serverapp_with_the_strategy(name: str) -> None:
    text = (DOCS / PAGES[name]).read_text()
    snippets = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    apps = []
    for snippet in snippets:  # each runs as written
        namespace: dict[str, object] = {}
        exec(compile(snippet, PAGES[name], "exec"), namespace)
        if "app" in namespace:
            apps.append(namespace)
    (namespace,) = apps
    assert isinstance(namespace["app"], ServerApp)
    assert namespace[name] is getattr(strategies, name)
