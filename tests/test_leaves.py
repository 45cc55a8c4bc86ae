"""Programs on many leaves: no kernel of an update reads every leaf's reduction.

A scalar summed leaf by leaf is an L-term chain that XLA copies into each per-leaf kernel
that reads it (the null step's select, a step size), so that such an update compiles into
L kernels of L operands each: a compile time quadratic in the leaves. The methods reduce
over the packed leaves instead (``hdm_optax._blocks``)."""

import re

import jax
import jax.numpy as jnp
import pytest

import hdm_optax

LEAVES = 24
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _wide_kernels(opt) -> list:
  """Operand counts of the fusions of one update (on LEAVES leaves) that read >= LEAVES."""
  params = {f"w{k:03d}": jnp.full(3, 0.1 * k) for k in range(LEAVES)}
  weights = jnp.arange(1.0, LEAVES + 1.0)

  def fun(p):  # each leaf's gradient reads its own leaf only
    return sum(w * jnp.sum((x - 1.0) ** 2) for w, x in zip(weights, jax.tree.leaves(p)))

  def update(params, state):
    value, grad = jax.value_and_grad(fun)(params)
    with hdm_optax.values_at_params():
      return opt.update(grad, state, params, value=value, grad=grad, value_fn=fun)

  text = jax.jit(update).lower(params, opt.init(params)).compile(FAST_COMPILE).as_text()
  wide = []
  for line in text.splitlines():
    found = re.search(r"= \S+ fusion\((.*?)\), kind=", line)
    if found and found.group(1).count("%") >= LEAVES:
      wide.append(found.group(1).count("%"))
  return wide


@pytest.mark.parametrize("name", ["trial_lbfgs", "hdm_auto", "hdm_best"])
def test_no_kernel_per_leaf_reads_every_leaf(name):
  """At most a few kernels read all the leaves (the value of f, a packing), not one per leaf
  (reductions summed leaf by leaf make 75-80 of them here)."""
  wide = _wide_kernels(getattr(hdm_optax, name)())
  assert len(wide) <= 6, wide
