"""``hdm_optax.optimistix_adapter``: :class:`HDMMinimiser`, from :mod:`hdm_optax.adapters.optimistix`.

Needs ``optimistix``; ``import hdm_optax`` does not import it.
"""

from hdm_optax.adapters.optimistix import ActiveBoundAdjointWarning
from hdm_optax.adapters.optimistix import HDMMinimiser
from hdm_optax.adapters.optimistix import HDMMinimiserState

__all__ = ("ActiveBoundAdjointWarning", "HDMMinimiser", "HDMMinimiserState")
