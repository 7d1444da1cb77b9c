"""The Flower apps ``flwr run .`` starts: a simulated fleet and its server.

``client_app`` is a simulated node (``flowerbed.sims.node``); ``server_app`` runs the
scenario named by the run config (``flowerbed.sims.scenario.run_server``).
"""

from __future__ import annotations

from logging import ERROR

from flowerbed.sims import node
from flowerbed.sims.config import ConfigError, Scenario
from flowerbed.sims.scenario import run_server
from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

client_app = ClientApp()
client_app.train()(node.train)
client_app.evaluate()(node.evaluate_local)
client_app.query()(node.profile)

server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Check the run config before anything trains, then run the scenario."""
    try:
        scenario = Scenario.from_run_config(context.run_config)
    except ConfigError as err:
        log(ERROR, "flowerbed: %s", err)
        raise
    outcome = run_server(grid, scenario)
    run_dir = outcome.run_dir.resolve() if outcome.run_dir else None
    print(f"flowerbed: run folder written to {run_dir}", flush=True)
