"""quickstart-mocha: the ClientApp (one MOCHA device per SuperNode)."""

from fmtl_flower import make_mocha_client_app
from quickstart_mocha.task import load_data

app = make_mocha_client_app(load_data)
