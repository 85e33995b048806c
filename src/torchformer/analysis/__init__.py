"""Looking inside models: attention capture, head statistics, plots and cost accounting."""

from .accounting import count_params

__all__ = ["count_params"]
