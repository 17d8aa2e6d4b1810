"""Answers a train message at once with a zero vector of the size it received."""

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """An update of the received size, no work."""
    w = msg.content["arrays"]["w"].numpy()
    reply = RecordDict({"arrays": ArrayRecord({"delta": Array(np.zeros_like(w))}),
                        "metrics": MetricRecord({"num-examples": 1})})
    return Message(reply, reply_to=msg)

