"""docs/simulation.md carries the catalogue as the code has it."""

from pathlib import Path

from flowerbed.sims.devices import catalogue_markdown

DOC = Path(__file__).parents[1] / "docs" / "simulation.md"


def test_device_table_in_the_docs_is_the_catalogue() -> None:
    assert catalogue_markdown() in DOC.read_text()
