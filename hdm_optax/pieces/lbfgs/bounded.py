r"""The L-BFGS step in a box: the operator on the free variables, the binding ones scaled.

The parts :func:`hdm_optax.pieces.lbfgs.direction.lbfgs_direction` adds in a box
(:mod:`hdm_optax.pieces.box` holds the box itself, its projection and its free set):

- :func:`free_part`: a vector restricted to the free variables;
- :func:`restricted_memory`: the secant pairs restricted to the free variables;
- :func:`free_scaling`: the :math:`\gamma` of :math:`H_0 = \gamma I` from a pair restricted
  to them;
- :func:`two_metric_step`: the trial step of a projected quasi-Newton iteration with one
  oracle call.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation with
  Hypergradient Descent*, arXiv:2502.11229, 2025 (the trial point and null step the box
  keeps); Bertsekas, *Projected Newton methods for optimization problems with simple constraints*,
  SIAM J. Control Optim. 20(2), 1982 (the binding set, the two-metric projection); Byrd, Lu,
  Nocedal, Zhu, *A limited memory algorithm for bound constrained optimization*, SIAM J. Sci.
  Comput. 16(5), 1995 (the subspace step of L-BFGS-B); Kim, Sra, Dhillon, *Tackling
  box-constrained optimization via a new projected quasi-Newton approach*, SIAM J. Sci.
  Comput. 32(6), 2010 (the quasi-Newton operator on the free variables).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _numerics
from hdm_optax.pieces import box as box_lib
from hdm_optax.pieces.lbfgs import memory as memory_lib

__all__ = (
  "free_part",
  "free_scaling",
  "restricted_memory",
  "two_metric_step",
)


def free_part(free, vector):
  """``vector`` on the free variables ``free`` (a boolean tree), 0 elsewhere.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces.lbfgs import bounded
    >>> [float(v) for v in bounded.free_part(jnp.array([False, True]), jnp.array([3.0, -0.25]))]
    [0.0, -0.25]
  """
  return jax.tree.map(jnp.where, free, vector, optax.tree.zeros_like(vector))


def free_scaling(free, step, change, full_scaling):
  r"""The :math:`\gamma` of :math:`H_0 = \gamma I` from a pair restricted to its free variables.

  .. math::
    \gamma = \frac{\langle s_F, y_F\rangle}{\langle y_F, y_F\rangle},

  F the variables free when the step s was proposed (:func:`hdm_optax.pieces.box.free_mask`),
  :math:`y = \nabla f(x + s) - \nabla f(x)`. H acts on the free variables
  (:func:`two_metric_step`), so its scale is the reduced Hessian's: a binding variable does
  not move (:math:`s_B = 0`) but its gradient change :math:`y_B` enters
  :math:`\langle y, y\rangle`, and where many variables sit at a bound with a large gradient
  the full pair's :math:`\langle s, y\rangle / \langle y, y\rangle` makes every step on the
  free variables too short. Where :math:`\langle s_F, y_F\rangle \le 0` it is
  ``full_scaling`` (the full pair's).

  Args:
    free: F, a boolean tree shaped like the params.
    step: s, the step taken.
    change: y, the gradient's change along it.
    full_scaling: :math:`\langle s, y\rangle / \langle y, y\rangle` of the full pair.

  Returns:
    :math:`\gamma`, a scalar of ``full_scaling``'s dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces.lbfgs import bounded
    >>> free = jnp.array([False, True])
    >>> s, y = jnp.array([0.0, 0.25]), jnp.array([4.0, 0.5])
    >>> float(bounded.free_scaling(free, s, y, jnp.asarray(0.125 / 16.25)))
    0.5
  """
  s_free, y_free = free_part(free, step), free_part(free, change)
  curvature = optax.tree.vdot(s_free, y_free)
  square = optax.tree.vdot(y_free, y_free)
  # Where ||y_F||^2 overflows (gradients of 1e19 in float32), from the rescaled norm.
  big = _numerics.scaled_norm(y_free, square)
  scaling = jnp.where(
    jnp.isfinite(square), curvature / jnp.where(curvature > 0, square, 1), curvature / big / big
  )
  return jnp.where(curvature > 0, scaling, full_scaling).astype(jnp.result_type(full_scaling))


def two_metric_step(
  box: box_lib.Box, x, updates, free, step_size, gamma, operator: Callable[[Any, Any], Any]
):
  r"""The projected quasi-Newton trial step of a one-call iteration.

  With F the free variables ``free`` (:func:`hdm_optax.pieces.box.free_mask` of the updates
  u, the gradient when the method is alone) and B the binding ones,

  .. math::
    d_F = H\,u_F, \qquad d_B = \gamma\, u_B, \qquad s = P(x - \alpha d) - x,

  H the ``operator`` applied to u restricted to F (zero on B, so that the pairs' coupling
  of a binding variable does not move a free one), B scaled by :math:`\gamma` as a
  gradient step (Bertsekas' two-metric projection; the projection keeps a binding
  variable where it is). The step is the projected step actually taken. Where it is not a
  descent direction (:math:`\langle u, s\rangle \ge 0`: the projection cut the
  quasi-Newton step so that what is left goes uphill), it is the projected scaled gradient
  step :math:`P(x - \alpha\gamma u) - x` instead, a descent direction wherever x is not
  stationary. Neither choice calls the oracle.

  Args:
    box: the :class:`hdm_optax.pieces.box.Box`.
    x: the iterate (in the box).
    updates: u, the incoming updates (the gradient when alone in a chain).
    free: F, a boolean tree shaped like the params.
    step_size: alpha.
    gamma: the scalar of :math:`H_0`.
    operator: ``(v, free) -> H v`` on the free variables, e.g.
      ``lambda v, free: two_loop_recursion(restricted_memory(memory, free), gamma, v)``.

  Returns:
    s, the step (a tree shaped like x).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import box
    >>> from hdm_optax.pieces.lbfgs import bounded
    >>> b = box.make_box(jnp.zeros(2), 0.0, 1.0)
    >>> x, g = jnp.array([0.0, 0.5]), jnp.array([3.0, -0.25])
    >>> free = box.free_mask(b, x, g)
    >>> [float(v) for v in bounded.two_metric_step(b, x, g, free, 1.0, 0.5, lambda v, f: v)]
    [0.0, 0.25]
  """
  newton = operator(free_part(free, updates), free)
  scaled = optax.tree.scale(gamma, updates)
  d = jax.tree.map(jnp.where, free, newton, scaled)
  step = box_lib.projected_step(box, x, optax.tree.scale(-step_size, d))
  fallback = box_lib.projected_step(box, x, optax.tree.scale(-step_size, scaled))
  descent = optax.tree.vdot(updates, step) < 0
  return optax.tree.where(descent, step, fallback)


# The pairs restricted to the free variables (with the memory, whose layout it reads).
restricted_memory = memory_lib.restricted_memory
