"""quickstart-mocha: the ServerApp (MOCHA, one model per device, Omega learned; the classes
are learned from the devices' labels, the intercept is ``mocha.fit-intercept``)."""

from logging import INFO

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fmtl_flower import MOCHA, MOCHASettings

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    # the [tool.flwr.app.config.mocha] table (mocha.lambda, mocha.omega-every,
    # mocha.fit-intercept), checked
    settings = MOCHASettings.from_run_config(config, omega="probabilistic")
    strategy = MOCHA(int(config["num-tasks"]), settings)
    strategy.start(grid=grid, num_rounds=int(config["num-server-rounds"]),
                   timeout=float(config["round-timeout"]))
    final = strategy.results()["final"]
    if not final["complete"]:
        raise RuntimeError(f"MOCHA did not hear from every task: {final.get('tasks_missing')}")
    log(INFO, "MOCHA final: %d classes %s, primal %.4f, duality gap %.3g, test error %.3f",
        len(strategy.classes), list(strategy.classes), final["primal"], final["gap"],
        final["test_error"])
