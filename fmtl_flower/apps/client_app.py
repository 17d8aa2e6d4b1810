"""The ClientApp ``flwr run .`` starts: node i serves task i of the configured dataset."""

from .common import make_client_app

app = make_client_app()
