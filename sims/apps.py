"""The Flower apps ``flwr run .`` starts: a simulated fleet and its server.

``client_app`` is a simulated node (``flowerbed.sims.node``), whose simulated
dropouts are quiet error replies; ``server_app`` runs the
scenario named by the run config (``flowerbed.sims.scenario.run_server``) on the grid
Flower hands it, wrapped in a :class:`~flowerbed.sims.virtual_grid.VirtualTimeGrid`
so that strategies see the simulated devices' time, as on the in-process engine.
"""

from __future__ import annotations

from types import TracebackType

from flowerbed.sims import node
from flowerbed.sims.config import ConfigError, Scenario
from flowerbed.sims.preflight import FAILURES, failure_line, preflight
from flowerbed.sims.scenario import run_server
from flowerbed.sims.virtual_grid import VirtualTimeGrid
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

client_app = node.make_client_app(raise_dropouts=False)

server_app = ServerApp()


class RunFailed(Exception):
    """Ends the ServerApp with one line that says what was wrong.

    Flower logs the exception that ends a ServerApp with its traceback
    (``log(..., exc_info=ex)``) and marks the run failed. The traceback of a bad
    run-config value or a missing folder only hides the message, so this exception
    reports none: Flower's log shows ``RunFailed: <message>``, once.
    """

    @property  # type: ignore[override]
    def __traceback__(self) -> TracebackType | None:
        return None

    @__traceback__.setter
    def __traceback__(self, value: TracebackType | None) -> None:
        pass


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Check the run config, the data, the memory and the output folder before
    anything trains (:func:`~flowerbed.sims.preflight.preflight`), then run the
    scenario; fail the run if no update was ever applied, or with one line if a
    disk or the memory fails it."""
    try:
        scenario = Scenario.from_run_config(context.run_config)
    except ConfigError as err:
        raise RunFailed(f"flowerbed: {err}") from None
    try:
        preflight(scenario, len(list(grid.get_node_ids())) or None)
        # Flower's engine answers on wall time; strategies see the device's time.
        outcome = run_server(VirtualTimeGrid(grid), scenario)
    except FAILURES as err:
        raise RunFailed(f"flowerbed: {failure_line(err, scenario)}") from None
    run_dir = outcome.run_dir.resolve() if outcome.run_dir else None
    print(f"flowerbed: run folder written to {run_dir}", flush=True)
    if outcome.problem is not None:
        raise RunFailed(f"flowerbed: {outcome.problem}")
