"""legacy-numpyclient: a ClientApp built the legacy way, ``client_fn`` + ``NumPyClient``."""

from flwr.app import Context
from flwr.client import Client
from flwr.clientapp import ClientApp

from fmtl_flower import MOCHANumPyClient
from legacy_numpyclient.task import load_partition


def client_fn(context: Context) -> Client:
    X, y, X_test, y_test = load_partition(int(context.node_config["partition-id"]),
                                          int(context.node_config["num-partitions"]))
    return MOCHANumPyClient(context, X, y, X_test, y_test).to_client()


app = ClientApp(client_fn=client_fn)
