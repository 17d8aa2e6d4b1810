"""Systems heterogeneity (local budgets) and simulated drop-outs."""

from .heterogeneity import SYS_HET_BASES, SYS_HET_LEVELS, drop_mask, local_budgets

__all__ = ["SYS_HET_BASES", "SYS_HET_LEVELS", "drop_mask", "local_budgets"]
