"""Per-iteration overhead of HDM-Best over one gradient evaluation, and its memory.

    python -m experiments.perf.overhead [--sizes 1e3,1e4,1e5,1e6] [--dtype float32]

Ridge logistic regression ``f(w) = sum_i log(1 + exp(-y_i <a_i, w>)) + 1e-2/2 ||w||^2``
(the ridge keeps ``grad f != 0``, so no run stops early) with n parameters on
synthetic data (``experiments.problems.synthetic_logistic``: labels from a planted logistic
model), from w = 0, float32 by default (``--dtype float64`` enables x64). The data are
arguments of the compiled programs (never constants):

- n <= 1e4: a dense ``m x n`` matrix with ``m = max(1e6 / n, 100)`` rows (1e6 entries);
- n >= 1e5: a ``jax.experimental.sparse.BCOO`` matrix with ``m = n / 2`` rows and
  ``k = 10`` nonzeros per row (nnz = 5 n, about the ratio of news20 or url).

For each n it prints, all measured inside compiled loops of K iterations
after a warm-up compile (best of ``--repeats`` runs), per oracle call (the
loops' time over their value-and-gradient calls: K + 1 for ``vg`` and
``solve``, plus the probes in ``solve``; K for ``update``, whose probes run
before the loop):

- ``t_vg``: one ``jax.value_and_grad`` call (a loop ``w <- w - c grad f(w)``, so
  also one axpy per iteration, needed to keep the loop data-dependent);
- ``t_update``: one HDM-Best iteration: f and grad f read from the state (where
  ``update`` caches them; ``optax.value_and_grad_from_state`` does the same
  behind a ``lax.cond``), one ``update`` (its single oracle call, at the trial
  point) and ``apply_updates``;
- ``t_solve``: one iteration of ``hdm_optax.solve(..., tol=0)`` (adds the
  trace and the ``||grad||_inf`` stopping test);
- the ratios ``t_update / t_vg`` and ``t_solve / t_vg`` (target <= 1.15 at n >= 1e5);
- ``state/params``: bytes of the optimizer state over bytes of the params,
  and the number of state leaves of size n;
- with ``--peers optax.lbfgs(),optx.LBFGS``: each peer's K-iteration solve from the same
  start, timed in the same interleaved rounds, per oracle call (its line search's calls
  counted), and the ratio of ``t_solve`` to it; how many of its calls computed a gradient
  (counted in a separate, untimed run: optimistix's backtracking evaluates f alone at a step
  it rejects), and the ratio per gradient evaluation.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from experiments import problems
from experiments import protocol
from experiments.perf import batched, timing


def _parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sizes", default="1e3,1e4,1e5,1e6")
  p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--steps", type=int, default=0, help="K (0: 200 for n < 1e6, else 50)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--optimizer",
    default="hdm_best",
    choices=tuple(OPTIMIZERS),
    help="hdm_best(lipschitz=L), hdm_auto() (no argument; its 3 probe updates, one call "
    "each, run before the timed loop of update and inside solve's) or trial_lbfgs()",
  )
  p.add_argument(
    "--peers",
    default="",
    help=f"comma-separated of {', '.join(PEERS)}: their K-iteration solves, timed "
    "interleaved with the rest, per oracle call (line-search calls counted)",
  )
  args = p.parse_args(argv)
  peers = tuple(filter(None, args.peers.split(",")))
  unknown = set(peers) - set(PEERS)
  if unknown:
    p.error(f"--peers: unknown {sorted(unknown)}; choose from {', '.join(PEERS)}")
  args.peers = peers
  return args


RIDGE = 1e-2

# name -> (factory of (hdm_optax, L), the probe updates that precede the iterations (one
# oracle call each))
OPTIMIZERS = {
  "hdm_best": (lambda hdm_optax, lip: hdm_optax.hdm_best(lipschitz=lip), 0),
  "hdm_auto": (lambda hdm_optax, lip: hdm_optax.hdm_auto(), 3),
  "trial_lbfgs": (lambda hdm_optax, lip: hdm_optax.trial_lbfgs(), 0),
  "trial_lbfgs(diagonal=None)": (lambda hdm_optax, lip: hdm_optax.trial_lbfgs(diagonal=None), 0),
}


PEERS = ("optax.lbfgs()", "optx.LBFGS")


def peer_programs(peers, fun, steps) -> dict:
  """name -> (compiled program of ``(w, data)``, its oracle calls from its output) for each
  peer: K iterations. ``optax.lbfgs()`` runs through ``hdm_optax.solve(tol=0)``, which
  counts its zoom line search's calls; ``optx.LBFGS`` (its Cauchy test off) through
  ``optimistix.minimise``, one call per step (``experiments/runner.py``)."""
  import optax

  import hdm_optax

  runs = {}
  if "optax.lbfgs()" in peers:
    solve = jax.jit(
      lambda w, d: hdm_optax.solve(optax.lbfgs(), fun, w, max_steps=steps, tol=0.0, fun_args=d)
    )
    runs["optax.lbfgs()"] = (solve, lambda res: int(res.num_grad_evals))
  if "optx.LBFGS" in peers:
    import optimistix as optx

    solver = optx.LBFGS(rtol=0.0, atol=0.0)

    @jax.jit
    def minimise(w, d):
      fn = lambda x, args: fun(x, *args)
      sol = optx.minimise(fn, solver, w, args=d, max_steps=steps, throw=False)
      return sol.value, sol.stats["num_steps"]

    runs["optx.LBFGS"] = (minimise, lambda out: int(out[1]))
  return runs


def counting_gradients(fun):
  """``(fun', count)``: ``fun'`` is ``fun`` whose reverse pass (a gradient, the transpose of
  a linearisation included) adds one to ``count[0]`` on the host each time it runs. Only for
  counting runs: the host call would be timed otherwise."""
  count = [0]

  @jax.custom_vjp
  def counted(w, *data):
    return fun(w, *data)

  def forward(w, *data):
    return jax.vjp(fun, w, *data)

  def backward(pullback, cotangent):
    jax.debug.callback(lambda: count.__setitem__(0, count[0] + 1))
    return pullback(cotangent)

  counted.defvjp(forward, backward)
  return counted, count


def peer_gradients(peers, fun, steps, w0, data) -> dict:
  """name -> the gradient evaluations of each peer's K-iteration run (a separate, untimed run
  of :func:`peer_programs` on the counting objective): optimistix's backtracking evaluates f
  alone at a rejected step (a linearisation, whose transpose runs only where the step is
  accepted), so its oracle calls are not all value-and-gradient calls."""
  out = {}
  for name in peers:
    counted, count = counting_gradients(fun)
    program, _ = peer_programs((name,), counted, steps)[name]
    jax.block_until_ready(program(w0, data))
    jax.effects_barrier()
    out[name] = count[0]
  return out


def make_problem(n: int, dtype, seed: int = 0):
  """Returns ``(fun, data, w0, L, kind)`` with ``fun(w, *data)``: the ridge logistic regression
  of ``experiments.problems.synthetic_logistic`` (dense with 1e6 entries up to n = 1e4, else
  BCOO with n / 2 rows and 10 nonzeros per row), from 0."""
  if n <= 10_000:
    m, nnz, kind = max(1_000_000 // n, 100), None, f"dense {max(1_000_000 // n, 100)}x{n}"
  else:
    m, nnz, kind = n // 2, 10, f"BCOO {n // 2}x{n}, nnz={n // 2 * 10}"
  inst = problems.synthetic_logistic(m, n, nnz_per_row=nnz, ridge=RIDGE, dtype=dtype, seed=seed)
  return inst.fun, inst.fun_args, inst.x0[0], inst.lipschitz, kind


def loops(opt, fun, probe_calls: int, steps: int):
  """The programs of one measurement, compiled: ``start_state(w, data)`` (the state after
  ``init`` and the probe updates), ``vg_loop(w, data)`` (K + 1 value-and-gradient calls),
  ``update_loop(w, data, state0)`` (K updates from ``state0``) and ``solve_run(w, data)``
  (``hdm_optax.solve(tol=0)`` for K iterations after the probes)."""
  import optax

  import hdm_optax

  @jax.jit
  def start_state(w, data):
    value_fn = lambda x: fun(x, *data)
    v, g = jax.value_and_grad(value_fn)(w)
    state = opt.init(w)._replace(value=v, grad=g)
    for _ in range(probe_calls):  # x stays in place
      _, state = opt.update(g, state, w, value=v, grad=g, value_fn=value_fn)
    return state

  @jax.jit
  def vg_loop(w, data):
    vg = jax.value_and_grad(fun)

    def body(_, c):
      w, acc = c
      v, g = vg(w, *data)
      return w - 1e-6 * g, acc + v

    v, g = vg(w, *data)  # K + 1 calls, as in solve
    return jax.lax.fori_loop(0, steps, body, (w - 1e-6 * g, v))

  @jax.jit
  def update_loop(w, data, state0):
    value_fn = lambda x: fun(x, *data)

    def body(_, c):
      w, state = c
      v, g = state.value, state.grad
      u, state = opt.update(g, state, w, value=v, grad=g, value_fn=value_fn)
      return optax.apply_updates(w, u), state

    return jax.lax.fori_loop(0, steps, body, (w, state0))

  def solve_run(w, data):
    # the probes are solve's first steps: K iterations follow them
    return hdm_optax.solve(opt, fun, w, max_steps=steps + probe_calls, tol=0.0, fun_args=data)

  return start_state, vg_loop, update_loop, solve_run


def measure(
  n: int,
  dtype,
  steps: int,
  repeats: int,
  seed: int = 0,
  optimizer: str = "hdm_best",
  peers: tuple[str, ...] = (),
):
  import hdm_optax

  fun, data, w0, lip, kind = make_problem(n, dtype, seed)
  factory, probe_calls = OPTIMIZERS[optimizer]  # = probe updates
  opt = factory(hdm_optax, lip)
  start_state, vg_loop, update_loop, solve_run = loops(opt, fun, probe_calls, steps)
  state0 = jax.block_until_ready(start_state(w0, data))

  fns = {
    "vg": lambda: vg_loop(w0, data),
    "update": lambda: update_loop(w0, data, state0),
    "solve": lambda: solve_run(w0, data),
  }
  peer_runs = peer_programs(peers, fun, steps)
  fns.update({name: (lambda p=p: p(w0, data)) for name, (p, _) in peer_runs.items()})
  seconds, outs = timing.best_times(fns, repeats)
  t_vg, t_up, t_solve = seconds["vg"], seconds["update"], seconds["solve"]
  (_, state), res = outs["update"], outs["solve"]
  if int(res.num_grad_evals) != steps + 1 + probe_calls:
    raise RuntimeError(
      f"solve stopped early: {res.num_steps} steps, {res.num_grad_evals} calls, status {res.status}"
    )
  assert int(state.info.num_grad_evals) == steps + probe_calls

  leaves = jax.tree.leaves(state)
  state_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
  param_bytes = w0.size * w0.dtype.itemsize
  big = [leaf for leaf in leaves if leaf.size >= n]
  # per oracle call: the vg loop makes K + 1 calls, the update loop K, solve K + 1 + probes
  vg_calls, solve_calls = steps + 1, steps + 1 + probe_calls
  per_vg, per_up, per_solve = t_vg / vg_calls, t_up / steps, t_solve / solve_calls
  peer_calls = {name: calls(outs[name]) for name, (_, calls) in peer_runs.items()}
  gradients = peer_gradients(peers, fun, steps, w0, data)
  return dict(
    n=n,
    kind=kind,
    steps=steps,
    t_vg=per_vg,
    t_update=per_up,
    t_solve=per_solve,
    ratio_update=per_up / per_vg,
    ratio_solve=per_solve / per_vg,
    state_ratio=state_bytes / param_bytes,
    n_vectors=len(big),
    n_leaves=len(leaves),
    f0=float(fun(w0, *data)),
    f_end=float(res.value),
    nulls=int(res.state.info.num_null_steps),
    peers={name: (seconds[name] / c, c) for name, c in peer_calls.items()},
    peer_gradients=gradients,
  )


def _print_row(r, args) -> None:
  print(
    f"{r['n']:>8} {r['kind']:>28} {r['steps']:>4} {r['t_vg'] * 1e3:>7.3f}ms "
    f"{r['t_update'] * 1e3:>7.3f}ms {r['t_solve'] * 1e3:>7.3f}ms "
    f"{r['ratio_update']:>7.3f} {r['ratio_solve']:>8.3f} {r['state_ratio']:>12.3f} "
    f"{r['n_vectors']:>9} {r['n_leaves']:>6}  {r['f0']:.4g} -> {r['f_end']:.4g} "
    f"({r['nulls']})",
    flush=True,
  )
  for name, (t, calls) in r["peers"].items():
    grads = r["peer_gradients"][name]
    print(
      f"{'':>8} {name}: {t * 1e3:.3f}ms per call ({calls} calls, {grads} with a gradient, in "
      f"{r['steps']} iterations), /vg {t / r['t_vg']:.3f}; {args.optimizer} solve per call / "
      f"{name}'s: {r['t_solve'] / t:.3f}; per gradient: {r['t_solve'] / (t * calls / grads):.3f}",
      flush=True,
    )


def main(argv=None) -> list[dict]:
  args = _parse(argv)
  if args.dtype == "float64":
    jax.config.update("jax_enable_x64", True)
  protocol.float32_products()
  dtype = np.dtype(args.dtype)
  sizes = [int(float(s)) for s in args.sizes.split(",")]
  device = batched.device_label()
  print(
    f"{args.optimizer}: jax {jax.__version__}, {device}, {dtype}, "
    f"best of {args.repeats} runs; times per oracle call"
  )
  header = (
    f"{'n':>8} {'data':>28} {'K':>4} {'t_vg':>9} {'t_update':>9} {'t_solve':>9} "
    f"{'upd/vg':>7} {'solve/vg':>8} {'state/params':>12} {'n-vectors':>9} "
    f"{'leaves':>6}  f0 -> f_K (null steps)"
  )
  print(header)
  rows = []
  for n in sizes:
    steps = args.steps or (200 if n < 1_000_000 else 50)
    r = measure(n, dtype, steps, args.repeats, args.seed, args.optimizer, args.peers)
    _print_row(r, args)
    rows.append(dict(r, optimizer=args.optimizer, device=device))
  return rows


if __name__ == "__main__":
  main()
