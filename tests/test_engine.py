"""The in-process engine streams: one message made and delivered per reply read."""

from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fmtl_flower.engine import InProcessGrid
from fmtl_flower.strategies.base import drain


def _echo_app(calls: list[int]):
    def app(message: Message, context) -> Message:
        calls.append(context.node_id)
        return Message(RecordDict({"metrics": MetricRecord({"node": context.node_id})}),
                       reply_to=message)
    return app


def _messages(grid: InProcessGrid, made: list[int]):
    for node in grid.get_node_ids():
        made.append(node)
        yield Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=node,
                      message_type="train")


def test_messages_are_made_and_delivered_one_at_a_time_as_replies_are_read():
    calls: list[int] = []
    grid = InProcessGrid(_echo_app(calls), 1000)
    made: list[int] = []
    replies = grid.send_and_receive(_messages(grid, made), timeout=60.0)
    assert made == [] and calls == []  # nothing made or delivered before the first read
    for k, reply in enumerate(replies, start=1):
        assert len(made) == k and len(calls) == k  # never more than one ahead
        assert reply.content["metrics"]["node"] == made[-1]
    assert len(calls) == 1000


def test_drain_delivers_what_was_not_read_and_offline_nodes_are_skipped():
    calls: list[int] = []
    grid = InProcessGrid(_echo_app(calls), 5)
    msgs = [Message(RecordDict(), dst_node_id=n, message_type="train") for n in grid.contexts]
    grid.offline.add(msgs[1].metadata.dst_node_id)
    replies = grid.send_and_receive(msgs)
    first = next(iter(replies))
    assert first.metadata.src_node_id == msgs[0].metadata.dst_node_id and len(calls) == 1
    drain(replies)
    assert len(calls) == 4 and msgs[1].metadata.dst_node_id not in calls
    drain([first])  # a plain list: nothing to do
    assert list(replies) == []


def test_push_and_pull_still_deliver_at_once():
    calls: list[int] = []
    grid = InProcessGrid(_echo_app(calls), 3)
    ids = list(grid.push_messages(
        [Message(RecordDict(), dst_node_id=n, message_type="train") for n in grid.contexts]))
    assert len(calls) == 3
    assert {r.metadata.src_node_id for r in grid.pull_messages(ids)} == set(grid.contexts)
