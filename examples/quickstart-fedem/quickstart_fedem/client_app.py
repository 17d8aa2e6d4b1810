"""quickstart-fedem: the ClientApp (one FedEM device per SuperNode)."""

from fmtl_flower import make_fedem_client_app
from quickstart_fedem.task import load_data

app = make_fedem_client_app(load_data)
