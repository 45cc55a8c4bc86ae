"""Adapters: other interfaces, as clients of the driver's public front doors.

They live beside the driver (:mod:`hdm_optax.driver`), not inside it, and call what a user
calls: :func:`hdm_optax.solve` and :func:`hdm_optax.loop`.

- :mod:`~hdm_optax.adapters.scipy_api`: :func:`hdm_optax.minimize`, SciPy's signature,
  options, callbacks and result, with :mod:`~hdm_optax.adapters.objective` for SciPy's
  ``fun``, ``jac`` and ``args``.
- :mod:`~hdm_optax.adapters.minibatch`: :func:`hdm_optax.minibatch_step`.
- :mod:`~hdm_optax.adapters.optimistix`: the loop as an optimistix minimiser (optional, needs
  optimistix; not imported here; :mod:`hdm_optax.optimistix_adapter`).
"""

from hdm_optax.adapters import minibatch
from hdm_optax.adapters import objective
from hdm_optax.adapters import scipy_api

__all__ = ("minibatch", "objective", "scipy_api")
