"""clients.common: the ClientApp our handlers are served by."""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fmtl_flower.clients.common import TaskClientApp, client_app_for


class Echo:
    """Handlers that say which one ran."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _answer(self, name: str, msg: Message) -> Message:
        self.calls.append(name)
        return Message(RecordDict({"c": ConfigRecord({"ran": name})}), reply_to=msg)

    def whoami(self, msg: Message, context: Context) -> Message:
        return self._answer("whoami", msg)

    def train(self, msg: Message, context: Context) -> Message:
        return self._answer("train", msg)

    def evaluate(self, msg: Message, context: Context) -> Message:
        return self._answer("evaluate", msg)


def _call(app: TaskClientApp, message_type: str) -> str:
    msg = Message(RecordDict(), 5, message_type)
    context = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    return app(msg, context).content["c"]["ran"]


def test_task_client_app_routes_as_flowers_client_app(monkeypatch):
    """Issue 17: the direct route runs the same handler as Flower's routing, and an app given
    a lifespan function (or a mod) still runs it through Flower's ClientApp.__call__."""
    for key, value in (("_run_id", 1), ("_node_id", 1), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, key, value)
    client = Echo()
    app = client_app_for(client)
    assert isinstance(app, TaskClientApp)
    for message_type, name in ((MessageType.TRAIN, "train"), (MessageType.EVALUATE, "evaluate"),
                               ("query.whoami", "whoami")):
        assert _call(app, message_type) == name
    events: list[str] = []

    @app.lifespan()
    def lifespan(context: Context):  # noqa: ANN202
        events.append("enter")
        yield
        events.append("exit")

    assert _call(app, MessageType.TRAIN) == "train" and events == ["enter", "exit"]
    seen: list[str] = []
    with_mod = TaskClientApp()
    with_mod.train(mods=[lambda msg, ctx, call: (seen.append("mod"), call(msg, ctx))[1]])(
        client.train)
    assert _call(with_mod, MessageType.TRAIN) == "train" and seen == ["mod"]
