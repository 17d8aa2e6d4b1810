"""quickstart-fedem: the ServerApp (FedEM: M shared components, a mixture per device)."""

from logging import INFO

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fmtl_flower import FedEM

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    strategy = FedEM(num_tasks=int(config["num-tasks"]), method=str(config["method"]),
                     num_components=int(config["num-components"]), model="softmax",
                     num_classes=3, lr=float(config["lr"]), batch_size=32)
    strategy.start(grid=grid, num_rounds=int(config["num-server-rounds"]),
                   timeout=float(config["round-timeout"]))
    final = strategy.results()["final"]
    if not final["complete"]:
        raise RuntimeError(f"FedEM did not hear from every task: {final.get('tasks_missing')}")
    log(INFO, "%s final: mean test accuracy %.3f, bottom decile %.3f", config["method"],
        final["accuracy_mean"], final["accuracy_bottom_decile"])
