"""quickstart-mocha: the ClientApp (one MOCHA device per SuperNode).

``labels="auto"``: the device's labels may be any K distinct values (here "red", "green",
"blue"); the server agrees on the class list at discovery and MOCHA learns one-vs-rest
models for all of them with one task relationship Omega.
"""

from fmtl_flower import make_mocha_client_app
from quickstart_mocha.task import load_data

app = make_mocha_client_app(load_data, labels="auto")
