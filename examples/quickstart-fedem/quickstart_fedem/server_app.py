"""quickstart-fedem: the ServerApp (FedEM: M shared components, a mixture per device)."""

from logging import INFO

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fmtl_flower import FedEM, FedEMSettings

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    # the [tool.flwr.app.config.fedem] table (fedem.M, fedem.lr), checked; "method" is this
    # app's own key (an unknown key is an error naming the closest valid one)
    settings = FedEMSettings.from_run_config(config, allow=["method"],
                                             method=str(config["method"]), model="softmax",
                                             num_classes=3, batch_size=32)
    strategy = FedEM(int(config["num-tasks"]), settings)
    strategy.start(grid=grid, num_rounds=int(config["num-server-rounds"]),
                   timeout=float(config["round-timeout"]))
    final = strategy.results()["final"]
    if not final["complete"]:
        raise RuntimeError(f"FedEM did not hear from every task: {final.get('tasks_missing')}")
    log(INFO, "%s final: mean test accuracy %.3f, bottom decile %.3f", config["method"],
        final["accuracy_mean"], final["accuracy_bottom_decile"])
