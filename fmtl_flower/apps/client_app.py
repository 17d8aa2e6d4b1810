"""The ClientApp ``flwr run .`` starts: node i serves task i of the configured dataset.

Its kernels follow the process's role (:mod:`fmtl_flower.apps.kernels`): numba for every call
inside Flower's simulation engine (when installed), the per-call ``auto`` rule in a
SuperNode's ClientApp process; ``FMTL_KERNELS`` wins over both.
"""

from .common import make_client_app
from .kernels import role_kernels

app = role_kernels(make_client_app())
