"""The ServerApp ``flwr run .`` starts (config from ``[tool.flwr.app.config]``/--run-config)."""

from .common import make_server_app

app = make_server_app()
