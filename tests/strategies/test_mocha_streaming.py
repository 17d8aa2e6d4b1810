"""MOCHA makes a round's messages lazily: with the streaming in-process engine, the k-th
device of a round is called when only k messages of that round exist."""

from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.clients.mocha import make_mocha_client_app
from fmtl_flower.engine import run_inprocess
from fmtl_flower.strategies.mocha import Mocha

from .helpers import make_problem


def test_each_train_message_is_made_just_before_its_device_is_called():
    problem = make_problem(num_tasks=40, dim=4)
    strategy = Mocha(40, lam=1e-3, discovery_timeout=5.0)
    client = make_mocha_client_app(problem.load)
    seen: list[tuple[int, int]] = []  # (messages made this round, train calls this round)
    calls = {"round": 0, "count": 0}

    def watching(message: Message, context: Context) -> Message:
        if message.metadata.message_type == "train":
            rnd = int(message.content["config"]["server-round"])
            if rnd != calls["round"]:
                calls.update(round=rnd, count=0)
            calls["count"] += 1
            seen.append((len(strategy._sent), calls["count"]))
        return client(message, context)

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, num_rounds=3, timeout=60.0)

    run_inprocess(server_app, watching, 40)
    assert len(seen) == 3 * 40
    assert all(made == called for made, called in seen)
    assert strategy.results()["final"]["num_replies"] == 40
