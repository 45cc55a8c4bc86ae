"""Programs on many leaves: no kernel of an update reads every leaf's reduction.

A scalar summed leaf by leaf is an L-term chain that XLA copies into each per-leaf kernel
that reads it (the null step's select, a step size), so that such an update compiles into
L kernels of L operands each: a compile time quadratic in the leaves. The methods reduce
over the packed leaves instead (``hdm_optax._blocks``)."""

import re

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import backends
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


@pytest.mark.parametrize(
  "make",
  [
    hdm_optax.hdm_auto,
    lambda: hdm_optax.hdm_best(lipschitz=40.0),
    hdm_optax.osgm_best,
    lambda: hdm_optax.hdm_agd(lipschitz=200.0),
  ],
)
def test_a_pytree_of_leaves_is_solved_as_its_raveled_vector(make):
  """The methods work on the packed vector (``hdm_optax._blocks.Packing``): a
  dict of small leaves takes the steps, calls and final point its raveled vector takes, and
  the state keeps the dict's layout."""
  params = {f"w{k:02d}": jnp.linspace(-1.0, 1.0, 3) * (k % 3) for k in range(8)}
  flat, _ = jax.flatten_util.ravel_pytree(params)
  scales = jnp.repeat(jnp.geomspace(1.0, 40.0, 8), 3)

  def fun_flat(x):
    return jnp.sum(scales * (x - 1.0) ** 2 + 0.01 * x**4)

  fun = lambda p: fun_flat(jax.flatten_util.ravel_pytree(p)[0])
  kw = dict(max_steps=300, tol=1e-8)
  tree = hdm_optax.solve(make(), fun, params, **kw)
  vector = hdm_optax.solve(make(), fun_flat, flat, **kw)
  assert int(tree.num_grad_evals) == int(vector.num_grad_evals)
  assert bool(tree.converged) and bool(vector.converged)
  # f on the dict is another program (the raveling fused into its sum of 24 positive terms):
  # its rounding over the steps, with the scales' condition number 40
  rtol = backends.rounding_tol(flat.size, int(vector.num_steps), condition=40.0)
  got = jax.flatten_util.ravel_pytree(tree.params)[0]
  np.testing.assert_allclose(got, vector.params, rtol=rtol, atol=rtol * np.max(np.abs(flat)))
  np.testing.assert_allclose(tree.trace.value, vector.trace.value, rtol=rtol)
  layout = jax.tree.structure(params)
  like_params = lambda node: jax.tree.structure(node) == layout
  nodes = jax.tree.leaves(tree.state, is_leaf=like_params)
  assert sum(map(like_params, nodes)) >= 2  # grad f and the method's own (P, z, ...)


def _update_equations(opt, leaves: int) -> int:
  """Equations of one update's jaxpr on ``leaves`` leaves of 3 entries, f on the raveled vector."""
  params = {f"w{k:03d}": jnp.full(3, 0.1 * k) for k in range(leaves)}
  fun = lambda p: jnp.sum((jax.flatten_util.ravel_pytree(p)[0] - 1.0) ** 2)

  def update(params, state):
    value, grad = jax.value_and_grad(fun)(params)
    with hdm_optax.values_at_params():
      return opt.update(grad, state, params, value=value, grad=grad, value_fn=fun)

  return len(jax.make_jaxpr(update)(params, opt.init(params)).jaxpr.eqns)


@pytest.mark.parametrize(
  "make",
  [
    hdm_optax.hdm_auto,
    lambda: hdm_optax.hdm_best(lipschitz=1.0),
    hdm_optax.osgm_best,
    hdm_optax.hdm,
    hdm_optax.hdm_hb,
    lambda: hdm_optax.hdm_agd(lipschitz=1.0),
    lambda: hdm_optax.trial_lbfgs(memory_size=10),  # the default m follows n
  ],
)
def test_an_update_grows_by_its_edges_per_leaf_not_by_its_work(make):
  """A leaf adds the packing's slices and concatenations (6-9 equations), not a copy of the
  method's per-coordinate work (32-48 before the methods packed their view)."""
  opt = make()
  per_leaf = (_update_equations(opt, 24) - _update_equations(opt, 4)) / 20
  assert per_leaf <= 12, per_leaf


def test_packing_leaves_a_node_alone_that_only_shares_the_params_structure():
  """Params (a, b) and a state holding a pair of scalars: only the params-shaped node is
  packed, and unpacking restores both as they were."""
  from hdm_optax import _blocks

  params = (jnp.arange(3.0), jnp.arange(2.0))
  state = {"p": params, "pair": (jnp.asarray(1.0), jnp.asarray(2.0))}
  packing = _blocks.Packing(params)
  packed = packing.pack(state)
  assert [b.shape for b in packed["p"]] == [(5,)]
  assert packed["pair"] is state["pair"] or packed["pair"] == state["pair"]
  back = packing.unpack_as(packed, state)
  assert jax.tree.map(jnp.shape, back) == jax.tree.map(jnp.shape, state)
  for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    np.testing.assert_array_equal(got, want)
