"""legacy-numpyclient: the ServerApp; LegacyGrid lets MOCHA talk to NumPyClient devices."""

from logging import INFO

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fmtl_flower import MOCHA, LegacyGrid, MOCHASettings

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    # the [tool.flwr.app.config.mocha] table (mocha.lambda, mocha.omega-every), checked
    strategy = MOCHA(int(config["num-tasks"]), MOCHASettings.from_run_config(config))
    strategy.start(grid=LegacyGrid(grid, client_api="numpyclient"),
                   num_rounds=int(config["num-server-rounds"]),
                   timeout=float(config["round-timeout"]))
    final = strategy.results()["final"]
    if not final["complete"]:
        raise RuntimeError(f"MOCHA did not hear from every task: {final.get('tasks_missing')}")
    log(INFO, "MOCHA final (NumPyClient devices): primal %.4f, duality gap %.3g, "
        "test error %.3f", final["primal"], final["gap"], final["test_error"])
