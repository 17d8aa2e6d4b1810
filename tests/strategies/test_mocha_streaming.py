"""MOCHA makes a round's messages lazily: with the streaming in-process engine, the k-th
device of a round is called when only k messages of that round exist."""

from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.clients.mocha import make_mocha_client_app
from fmtl_flower.engine import InProcessGrid, run_inprocess
from fmtl_flower.strategies.mocha import MOCHA

from .helpers import make_problem


def test_each_train_message_is_made_just_before_its_device_is_called():
    problem = make_problem(num_tasks=40, dim=4)
    strategy = MOCHA(40, lam=1e-3, discovery_timeout=5.0)
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


class TwoPassGrid(InProcessGrid):
    """Takes messages as Flower's HttpGrid does: one pass to check them, one to send them."""

    streams_messages = False

    def send_and_receive(self, messages, *, timeout=None):
        for message in messages:
            assert message.metadata.dst_node_id in self.contexts
        return list(super().send_and_receive(list(messages), timeout=timeout))


def test_a_grid_that_iterates_twice_gets_every_message():
    problem = make_problem(num_tasks=8, dim=4)
    strategy = MOCHA(8, lam=1e-3, discovery_timeout=5.0)
    grid = TwoPassGrid(make_mocha_client_app(problem.load), 8)
    strategy.start(grid=grid, num_rounds=3, timeout=60.0)
    records = strategy.results()["rounds"]
    assert [r["num_replies"] for r in records[1:]] == [8, 8, 8]
    assert strategy.results()["final"]["num_replies"] == 8
