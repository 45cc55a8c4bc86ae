"""The driver's layering: each module imports only modules below it, and the adjoint picks
the loop (hdm_optax/driver/__init__.py, docs/research/engine.md)."""

import ast
from pathlib import Path

import jax.numpy as jnp
import optax
import pytest

import hdm_optax
from hdm_optax.driver import adjoint, protocol, runs

DRIVER = Path(hdm_optax.__file__).parent / "driver"

# Bottom to top; a module imports only modules of lower layers.
LAYERS = [
  {"compiled", "host", "protocol"},  # protocol: what a driver reads of an optimizer
  {"limits", "programs", "results", "interrupts"},
  {"hooks", "members", "resuming"},
  {"cache", "engine"},  # cache: takes the optimizer's cache only on the data resuming kept
  {"runs", "oracle"},
  {"adjoint", "store"},
  {"separate"},  # the method's program apart from the objective
  {"solving", "batching"},  # the engine's own front doors
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def driver_imports(path: Path) -> set:
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module == "hdm_optax.driver":
        found |= {alias.name for alias in node.names}
      elif node.module.startswith("hdm_optax.driver."):
        found.add(node.module.split(".")[2])
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith("hdm_optax.driver."):
          found.add(alias.name.split(".")[2])
  return found


def test_every_driver_module_has_a_layer():
  modules = {p.stem for p in DRIVER.glob("*.py")} - {"__init__"}
  assert modules == set(LAYER)


@pytest.mark.parametrize("name", sorted(LAYER))
def test_a_module_imports_only_modules_below_it(name):
  for imported in driver_imports(DRIVER / f"{name}.py"):
    assert LAYER[imported] < LAYER[name], f"{name} imports {imported}"


def test_the_driver_imports_no_method_and_no_adapter():
  """The adapters (minimize, minibatch_step, the optimistix minimiser) are clients of the
  driver, beside it; the methods meet it only in the protocols."""
  for path in DRIVER.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module:
        assert not node.module.startswith(("hdm_optax.adapters", "hdm_optax.methods")), path
        assert node.module != "hdm_optax" or not {a.name for a in node.names} & {
          "adapters",
          "methods",
        }, path


def test_the_adjoint_picks_the_loop():
  implicit, unrolled = adjoint.ImplicitAdjoint(), adjoint.UnrolledAdjoint(checkpoint=False)
  assert implicit.primitive(1, 1000) == runs.While()
  assert implicit.primitive(8, 1000) == runs.Blocks(8)
  assert implicit.batch_primitive(80, True, True, 1000) == runs.Staged((80, 20, 5), True)
  assert implicit.batch_primitive(80, False, False, 1000) == runs.Staged((80,), False)
  assert unrolled.primitive(1, 30) == runs.Scan(30, False)
  assert unrolled.batch_primitive(4, False, False, 30) == runs.Lockstep(runs.Scan(30, False))
  with pytest.raises(ValueError, match="check_every=1"):
    unrolled.primitive(4, 30)
  with pytest.raises(ValueError, match="stop_at_first_converged"):
    unrolled.batch_primitive(4, False, True, 30)
  with pytest.raises(ValueError, match="compact=True"):
    unrolled.batch_primitive(4, True, False, 30)


def test_front_doors_do_not_ask_which_adjoint():
  for name in ("solving", "batching"):
    source = (DRIVER / f"{name}.py").read_text()
    assert "isinstance(adjoint" not in source and "UnrolledAdjoint)" not in source, name


@pytest.mark.parametrize(
  "make",
  [
    lambda: hdm_optax.trial_lbfgs(lower=0.0),
    hdm_optax.hdm,
    hdm_optax.hdm_hb,
    lambda: hdm_optax.hdm_agd(lipschitz=1.0),
    hdm_optax.hdm_best,
    hdm_optax.hdm_auto,
    hdm_optax.osgm_best,
  ],
)
def test_every_method_state_speaks_the_protocol(make):
  """What the driver reads of an hdm_optax state (verdict, box, preconditioner) it reads by
  the protocol; optax's own states get the defaults."""
  state = make().init(jnp.ones(2))
  assert isinstance(state, protocol.OptimizerState)
  assert bool(protocol.accepted(state))
  assert protocol.accepted(optax.adam(0.1).init(jnp.ones(2))).dtype == jnp.bool_
  assert protocol.box_of(optax.adam(0.1).init(jnp.ones(2))) is None
  assert protocol.preconditioner(optax.lbfgs().init(jnp.ones(2))) is None
