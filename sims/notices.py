"""Flower's notices about settings flowerbed chose, kept out of flowerbed's commands.

Flower's ``FedAvg`` logs a WARNING when it is built with ``fraction_evaluate=0.0``
("Federated evaluation will be skipped."). flowerbed's simulations evaluate on the
server and set that value themselves, so the warning would open every
``flowerbed sim``, ``flowerbed pipeline`` and ``flwr run .`` run with advice about
a setting the user never made. :func:`our_settings` drops exactly those notices,
from Flower's logger, while flowerbed builds a strategy; a strategy built by the
user's own code warns as Flower intends.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

FLOWER_LOGGER = "flwr"
"""The logger Flower logs through (``flwr.common.logger.LOGGER_NAME``)."""

FRACTION_EVALUATE_NOTICE = "fraction_evaluate is set to 0.0."
"""How Flower's notice about ``fraction_evaluate=0.0`` begins."""


class _DropNotices(logging.Filter):
    """Refuses the records whose message begins with one of ``notices``."""

    def __init__(self, notices: tuple[str, ...]) -> None:
        super().__init__()
        self.notices = notices

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.notices)


@contextmanager
def our_settings(*notices: str) -> Iterator[None]:
    """Within the block, Flower does not log ``notices`` (message beginnings):
    the notices of settings flowerbed chose. Default: the ``fraction_evaluate``
    one."""
    drop = _DropNotices(notices or (FRACTION_EVALUATE_NOTICE,))
    logger = logging.getLogger(FLOWER_LOGGER)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
