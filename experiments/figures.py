"""The paper's figures: Table 1 convergence plots (Figures 4-5, Appendix E) and the toy quadratic (Figures 1-3).

    python -m experiments.figures [--results results] [--out results/figures] [--pdf]
        [--datasets heart_scale ...] [--toy-only] [--datasets-only]

Dataset figures. For every ``<results>/<problem>/<dataset>.npz`` written by
``python -m experiments.table1``: ``<out>/<problem>/<dataset>.png``, two panels,
f - f* and ||grad f||_inf against gradient calls (log y), one line per
algorithm, f* = the lowest value any algorithm reached minus 1e-10, and the
stopping tolerance 1e-4 in the gradient panel. A legend entry reads
``name (gradient calls to tol)`` or ``name (-)`` if the run did not solve
the instance (from ``<dataset>.csv``).

Toy figures (``<out>/toy/``, float64, captions and numbers in ``<out>/toy/README.md``),
all on the toy quadratic of :mod:`experiments.toy`:
``f(x) = 1/2 x^T A x``, ``A = diag(logspace(0, 2, 5))`` (n = 5, L = 100,
mu = 1, condition number 100, f* = 0), ``x^1 = (1, ..., 1)``, f(x^1) = 72.9.

- figure1a: vanilla HDM (no null step; diagonal P, online gradient descent with
  eta = 1e-3, P_1 = 0.1 I) against GD (step 1/L): f climbs to 1.8e29 (2.4e27
  f(x^1)) at iteration 54, then converges superlinearly: f <= 1e-10 at iteration
  108 and 1e-30 at 242 (GD: 1e-10 after 1112 iterations).
- figure1b: the same HDM with the null step (monotone, no spike), HDM-Best
  (``hdm_best(lipschitz=L)``, its defaults), vanilla HDM and GD.
- figure2: HDM with null step, online gradient descent (eta in 1e-3, 3e-3,
  1e-2) against AdaGrad (eta in 1e-2, 1e-1, 1) as the online learner.
- figure3a: HDM-HB with full and diagonal P, scalar momentum (AdaGrad,
  eta_p = eta_b = 0.1, omega = tau = 0) against heavy ball
  x+ = x - alpha g + beta (x - x_prev) with (alpha, beta) grid-searched.
- figure3b: HDM-AGD (``hdm_agd(lipschitz=L)``, diagonal P, AdaGrad, eta = 0.1,
  theta = 1) against AGD-CVX and AGD-SCVX (step 1/L) of
  :mod:`experiments.baselines.first_order`. HDM-AGD makes 3 gradient calls per iteration.
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402
from tqdm import tqdm  # noqa: E402

import hdm_optax  # noqa: E402
from experiments.baselines import first_order  # noqa: E402
from experiments import toy  # noqa: E402

TOL = 1e-4
DPI = 110

# One style per algorithm, shared by all dataset figures (legend order).
_FIRST, _ADAPT, _QN, _HDM = "--", ":", "-.", "-"
STYLES = {
  "GD": dict(color="#7f7f7f", ls=_FIRST),
  "GD-HB": dict(color="#8c564b", ls=_FIRST),
  "AGD-CVX": dict(color="#bcbd22", ls=_FIRST),
  "AGD-SCVX": dict(color="#c49c94", ls=_FIRST),
  "Adam": dict(color="#e377c2", ls=_ADAPT, lw=1.8),
  "AdaGrad": dict(color="#9467bd", ls=_ADAPT, lw=1.8),
  "BFGS": dict(color="#08306b", ls=_QN),
  "L-BFGS-M1": dict(color="#9ecae1", ls=_QN),
  "L-BFGS-M3": dict(color="#6baed6", ls=_QN),
  "L-BFGS-M5": dict(color="#3182bd", ls=_QN),
  "L-BFGS-M10": dict(color="#1c5a9c", ls=_QN),
  "optax-L-BFGS": dict(color="#17becf", ls=_QN),
  "HDM": dict(color="#ff7f0e", ls=_HDM),
  "HDM-HB": dict(color="#2ca02c", ls=_HDM),
  "HDM-AGD": dict(color="#98df8a", ls=_HDM),
  "HDM-Best-default": dict(color="#ff9896", ls=_HDM, lw=1.6),
  "HDM-Auto": dict(color="#8c564b", ls=_HDM, lw=1.8),
  "OSGM-Best": dict(color="#7f7f7f", ls=_HDM, lw=1.6),
  "HDM-Best": dict(color="#d62728", ls=_HDM, lw=2.8, zorder=10),
}


def style(name: str, index: int = 0) -> dict:
  """Line style of an algorithm (unknown names cycle through the default colours)."""
  default = dict(color=f"C{index % 10}", ls=_HDM)
  return {"lw": 1.3, "zorder": 2, **STYLES.get(name, default)}


# ---------------------------------------------------------------------------
# Dataset figures (Figures 4-5, Appendix E).
# ---------------------------------------------------------------------------


def load_instance(npz_path: Path):
  """``{algorithm: (grad_calls, value, grad_inf)}`` and the CSV rows by algorithm."""
  traces = {}
  with np.load(npz_path) as data:
    for key in data.files:
      name, field = key.rsplit("/", 1)
      traces.setdefault(name, {})[field] = np.asarray(data[key], np.float64)
  traces = {n: (t["grad_calls"], t["value"], t["grad_inf"]) for n, t in traces.items()}
  rows = {}
  csv_path = npz_path.with_suffix(".csv")
  if csv_path.exists():
    with open(csv_path, newline="") as f:
      rows = {r["algorithm"]: r for r in csv.DictReader(f)}
  return traces, rows


def _label(name: str, row) -> str:
  if row is None:
    return name
  return f"{name} ({row['grad_calls']})" if row.get("solved") == "1" else f"{name} (-)"


def plot_instance(npz_path: Path, out_png: Path, problem: str, dataset: str, pdf=False):
  traces, rows = load_instance(npz_path)
  order = [n for n in STYLES if n in traces] + sorted(n for n in traces if n not in STYLES)
  fstar = min(float(np.nanmin(v)) for _, v, _ in traces.values()) - 1e-10
  fig, (ax_f, ax_g) = plt.subplots(1, 2, figsize=(11, 5.2))
  for i, name in enumerate(order):
    calls, value, grad_inf = traces[name]
    kw = style(name, i)
    ax_f.plot(calls, value - fstar, label=_label(name, rows.get(name)), **kw)
    ax_g.plot(calls, grad_inf, **kw)
  ax_g.axhline(TOL, color="k", lw=0.8, ls=(0, (1, 1)), zorder=1)
  ax_g.annotate(
    "tol = 1e-4",
    (1.0, TOL),
    xycoords=("axes fraction", "data"),
    ha="right",
    va="bottom",
    fontsize=8,
  )
  for ax, ylabel in ((ax_f, r"$f(x) - f^\star$"), (ax_g, r"$\|\nabla f(x)\|_\infty$")):
    ax.set_yscale("log")
    ax.set_xlabel("gradient calls")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
  fig.suptitle(f"{dataset} ({problem})")
  fig.legend(
    loc="lower center",
    ncol=6,
    fontsize=8,
    frameon=False,
    title="algorithm (gradient calls to tol; - = not solved)",
    title_fontsize=8,
  )
  fig.tight_layout(rect=(0, 0.15, 1, 1))
  _save(fig, out_png, pdf)


def make_dataset_figures(results: Path, out: Path, datasets=None, pdf=False):
  """One figure per ``<results>/<problem>/<dataset>.npz``; returns the PNG paths."""
  instances = sorted(
    p for p in Path(results).glob("*/*.npz") if datasets is None or p.stem in datasets
  )
  pngs = []
  for npz in tqdm(instances, desc="dataset figures", unit="fig"):
    problem, dataset = npz.parent.name, npz.stem
    png = Path(out) / problem / f"{dataset}.png"
    plot_instance(npz, png, problem, dataset, pdf)
    pngs.append(png)
  return pngs


def _save(fig, png: Path, pdf: bool):
  """PNG with a 256-colour palette (~3x smaller than RGBA), optionally a PDF."""
  png.parent.mkdir(parents=True, exist_ok=True)
  buffer = io.BytesIO()
  fig.savefig(buffer, dpi=DPI)
  buffer.seek(0)
  with Image.open(buffer) as image:
    image.convert("RGB").quantize(256, Image.Quantize.FASTOCTREE).save(png, optimize=True)
  if pdf:
    fig.savefig(png.with_suffix(".pdf"))
  plt.close(fig)


# ---------------------------------------------------------------------------
# Toy quadratic figures (Figures 1-3).
# ---------------------------------------------------------------------------

TOY_L, TOY_MU = 100.0, 1.0
OGD_LRS = (1e-3, 3e-3, 1e-2)  # figure 2, online gradient descent (1e-3: VANILLA_HDM)
ADAGRAD_LRS = (1e-2, 1e-1, 1.0)  # figure 2, AdaGrad
HDM_HB = dict(momentum_candidate="scalar", learner="adagrad", precond_lr=0.1, momentum_lr=0.1)
HDM_AGD = dict(candidate="diagonal", learner="adagrad", precond_lr=0.1, theta=1.0)
HB_ALPHAS = tuple(np.round(np.logspace(np.log10(0.5), np.log10(5.0), 15) / TOY_L, 6))
HB_BETAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
FIG_STEPS = dict(figure1a=500, figure1b=300, figure2=250, figure3a=200, figure3b=500)
TARGET = 1e-10  # "iterations to f - f* <= 1e-10" in the captions
YLIM = dict(figure1a=(1e-32, 1e34), figure1b=(1e-20, 1e34))  # others: (1e-20, 1e4)


# The runs are tiny: compile fast (~2x) rather than optimise the program.
@functools.partial(
  jax.jit,
  static_argnums=2,
  compiler_options={"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True},
)
def _toy_traces(x0, A, steps):
  """All toy runs in one compiled program: name -> (values, grad_evals), batched for grids."""

  def run(opt):
    r = hdm_optax.solve(
      opt, toy.toy_objective, x0, max_steps=steps, tol=0.0, fun_args=(A,), trace=steps + 1
    )
    return r.trace.value, r.trace.grad_evals

  def grid(make, *columns):
    return jax.vmap(lambda *p: run(make(*p)))(*(jnp.asarray(c, x0.dtype) for c in columns))

  L = TOY_L
  scvx = (np.sqrt(L) - np.sqrt(TOY_MU)) / (np.sqrt(L) + np.sqrt(TOY_MU))
  alphas, betas = np.meshgrid(HB_ALPHAS, HB_BETAS, indexing="ij")
  n_hb = alphas.size
  # lr, momentum, nesterov, lambda_schedule: heavy-ball grid, GD, AGD-CVX, AGD-SCVX.
  family = np.array(
    [
      *zip(alphas.ravel(), betas.ravel(), [0] * n_hb, [0] * n_hb),
      (1 / L, 0, 0, 0),
      (1 / L, 0, 1, 1),
      (1 / L, scvx, 1, 0),
    ]
  )
  fo = grid(first_order.first_order_family, *family.T)

  def hdm(**kw):  # HDM with null step, the settings of figure 1 unless overridden
    return hdm_optax.hdm(null_step=True, **{**toy.VANILLA_HDM, **kw})

  return {
    "heavy ball grid": jax.tree.map(lambda a: a[:n_hb], fo),
    "GD": jax.tree.map(lambda a: a[n_hb], fo),
    "AGD-CVX": jax.tree.map(lambda a: a[n_hb + 1], fo),
    "AGD-SCVX": jax.tree.map(lambda a: a[n_hb + 2], fo),
    "vanilla HDM": run(hdm_optax.hdm(null_step=False, **toy.VANILLA_HDM)),
    "HDM OGD": grid(lambda lr: hdm(learner="ogd", precond_lr=lr), OGD_LRS),
    "HDM AdaGrad": grid(lambda lr: hdm(learner="adagrad", precond_lr=lr), ADAGRAD_LRS),
    "HDM-Best": run(hdm_optax.hdm_best(lipschitz=L)),
    "HDM-HB full": run(hdm_optax.hdm_hb(candidate="full", **HDM_HB)),
    "HDM-HB diagonal": run(hdm_optax.hdm_hb(candidate="diagonal", **HDM_HB)),
    "HDM-AGD": run(hdm_optax.hdm_agd(lipschitz=L, **HDM_AGD)),
  }


def toy_runs(steps: int = max(FIG_STEPS.values())):
  """Runs every toy experiment in float64; returns name -> (f - f*, grad_evals) NumPy arrays."""
  with jax.enable_x64(True):
    A, x0 = toy.toy_quadratic()
    assert np.isclose(np.max(A), TOY_L) and np.isclose(np.min(np.diag(A)), TOY_MU)
    raw = jax.device_get(_toy_traces(jnp.asarray(x0), jnp.asarray(A), steps))
  runs = {k: (np.asarray(v, np.float64), np.asarray(g)) for k, (v, g) in raw.items()}
  for name, lrs in (("HDM OGD", OGD_LRS), ("HDM AdaGrad", ADAGRAD_LRS)):
    v, g = runs.pop(name)
    runs.update({f"{name} eta={lr:g}": (v[i], g[i]) for i, lr in enumerate(lrs)})
  v, g = runs.pop("heavy ball grid")
  best = min(range(len(v)), key=lambda i: (_hit(v[i]), v[i][-1]))
  a, b = np.meshgrid(HB_ALPHAS, HB_BETAS, indexing="ij")
  runs[f"heavy ball alpha={a.ravel()[best]:.3g} beta={b.ravel()[best]:g}"] = (v[best], g[best])
  return runs


def _hit(gap) -> int:
  """First iteration with f - f* <= TARGET (a large number if never)."""
  hits = np.nonzero(gap <= TARGET)[0]
  return int(hits[0]) if hits.size else 10**9


def _toy_lines(runs, figure):
  """(run name, legend label, style) of every line of a toy figure."""
  hb = next(k for k in runs if k.startswith("heavy ball"))
  gd = ("GD", "GD (step 1/L)", dict(color="#7f7f7f", ls="--"))
  vanilla = ("vanilla HDM", "vanilla HDM (no null step)", dict(color="#ff7f0e"))
  null = ("HDM OGD eta=0.001", "HDM + null step", dict(color="#1f77b4"))
  if figure == "figure1a":
    return [gd, vanilla]
  if figure == "figure1b":
    return [gd, vanilla, null, ("HDM-Best", "HDM-Best", dict(color="#d62728", lw=2.5))]
  if figure == "figure2":
    blues, reds = ("#9ecae1", "#4292c6", "#08519c"), ("#fcae91", "#fb6a4a", "#a50f15")
    return [
      (f"HDM OGD eta={lr:g}", f"online GD, eta={lr:g}", dict(color=c))
      for lr, c in zip(OGD_LRS, blues)
    ] + [
      (f"HDM AdaGrad eta={lr:g}", f"AdaGrad, eta={lr:g}", dict(color=c, ls="-."))
      for lr, c in zip(ADAGRAD_LRS, reds)
    ]
  if figure == "figure3a":
    alpha, beta = (float(w.split("=")[1]) for w in hb.split()[2:])
    return [
      (hb, f"heavy ball, tuned alpha={alpha:g}, beta={beta:g}", dict(color="#8c564b", ls="--")),
      ("HDM-HB full", "HDM-HB, full P", dict(color="#d62728", lw=2)),
      ("HDM-HB diagonal", "HDM-HB, diagonal P", dict(color="#2ca02c", ls="-.")),
    ]
  return [
    ("AGD-CVX", "AGD-CVX (step 1/L)", dict(color="#bcbd22", ls="--")),
    ("AGD-SCVX", "AGD-SCVX (step 1/L)", dict(color="#8c564b", ls="--")),
    ("HDM-AGD", "HDM-AGD (3 gradient calls per iteration)", dict(color="#d62728", lw=2)),
  ]


TOY_TITLES = dict(
  figure1a="Figure 1a: two-phase behaviour of vanilla HDM",
  figure1b="Figure 1b: null step and HDM-Best",
  figure2="Figure 2: online learner of HDM (null step)",
  figure3a="Figure 3a: HDM-HB",
  figure3b="Figure 3b: HDM-AGD",
)


def plot_toy(runs, figure: str, out_png: Path, steps: int, pdf=False):
  fig, ax = plt.subplots(figsize=(6, 4.3))
  for name, label, kw in _toy_lines(runs, figure):
    gap = runs[name][0][: steps + 1]
    ax.plot(np.arange(gap.size), np.where(gap > 0, gap, np.nan), label=label, **{"lw": 1.5, **kw})
  ax.set_yscale("log")
  ax.set_ylim(*YLIM.get(figure, (1e-20, 1e4)))
  ax.set_xlim(0, steps)
  ax.set_xlabel("iteration k")
  ax.set_ylabel(r"$f(x^k) - f^\star$")
  ax.set_title(TOY_TITLES[figure], fontsize=10)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8, loc="upper right")
  fig.tight_layout()
  _save(fig, out_png, pdf)


def _describe(runs, figure, f1, steps):
  lines = []
  for name, label, _ in _toy_lines(runs, figure):
    gap, calls = runs[name][0][: steps + 1], runs[name][1][: steps + 1]
    k = _hit(gap)
    reach = (
      f"reaches f - f* <= {TARGET:g} at iteration {k} ({int(calls[k])} gradient calls)"
      if k <= steps
      else f"f - f* = {gap[-1]:.2e} after {steps} iterations"
    )
    shape = "monotone" if np.all(np.diff(gap) <= 0) else "not monotone"
    lines.append(
      f"- {label}: max f - f* = {gap.max():.2e} ({gap.max() / f1:.2e} f(x^1)), "
      f"{shape}, final {gap[-1]:.2e}; {reach}."
    )
  return "\n".join(lines)


def write_toy_readme(runs, out: Path, steps_of):
  f1 = float(runs["GD"][0][0])
  text = [
    "# Toy quadratic figures (Figures 1-3 of the paper)",
    "",
    "Generated by `python -m experiments.figures --toy-only` in float64 with "
    "`hdm_optax.solve` (tol = 0, fixed iteration budget).",
    "",
    "Problem (`experiments.toy.toy_quadratic()`): f(x) = 1/2 x^T A x with "
    "A = diag(logspace(0, 2, 5)) = diag(1, 3.16, 10, 31.6, 100): n = 5, L = 100, "
    f"mu = 1, condition number 100, x* = 0, f* = 0; x^1 = (1, ..., 1), f(x^1) = {f1:.4g}.",
    "",
    "Hyper-parameters: HDM uses a diagonal P with P_1 = 0.1 I (ten times 1/L); "
    f"vanilla HDM and 'HDM + null step' use online gradient descent with eta = 1e-3 "
    f"(`experiments.toy.VANILLA_HDM`); HDM-Best = `hdm_best(lipschitz=100)` (defaults); "
    f"HDM-HB = `hdm_hb({_kwargs(HDM_HB)})` (omega = tau = 0, P_1 = 0, beta_1 = 0); "
    f"HDM-AGD = `hdm_agd(lipschitz=100, {_kwargs(HDM_AGD)})` (3 gradient calls per "
    "iteration); heavy ball x+ = x - alpha g + beta (x - x_prev) with (alpha, beta) "
    f"chosen on the grid alpha in {{{', '.join(f'{a:g}' for a in HB_ALPHAS)}}} x "
    f"beta in {{{', '.join(f'{b:g}' for b in HB_BETAS)}}} "
    f"(fewest iterations to f - f* <= {TARGET:g}); GD and AGD use step 1/L; "
    "AGD-SCVX uses momentum (sqrt(L) - sqrt(mu)) / (sqrt(L) + sqrt(mu)).",
    "",
  ]
  captions = dict(
    figure1a="Vanilla HDM (no null step) against GD: f(x^k) spikes by many orders "
    "of magnitude in the warm-up phase, then converges superlinearly.",
    figure1b="The null step flattens the spike (monotone f) but does not shorten the "
    "warm-up; HDM-Best converges fastest.",
    figure2="HDM with null step: online gradient descent against AdaGrad as the "
    "online learner, three step sizes each.",
    figure3a="HDM-HB (full and diagonal P, scalar momentum) against heavy ball with "
    "the best constant (alpha, beta).",
    figure3b="HDM-AGD against AGD (Nesterov momentum, step 1/L).",
  )
  for figure, caption in captions.items():
    steps = steps_of[figure]
    text += [
      f"## {figure}.png ({steps} iterations)",
      "",
      caption,
      "",
      _describe(runs, figure, f1, steps),
      "",
    ]
  (out / "README.md").write_text("\n".join(text))


def _kwargs(d):
  return ", ".join(f"{k}={v!r}" for k, v in d.items())


def make_toy_figures(out: Path, steps: int | None = None, pdf=False):
  """Figures 1a, 1b, 2, 3a, 3b and README.md in ``out``; ``steps`` caps every figure's
  iteration budget (for quick tests). Returns the PNG paths."""
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  steps_of = {f: s if steps is None else min(s, steps) for f, s in FIG_STEPS.items()}
  runs = toy_runs(max(steps_of.values()))
  pngs = []
  for figure in tqdm(FIG_STEPS, desc="toy figures", unit="fig"):
    png = out / f"{figure}.png"
    plot_toy(runs, figure, png, steps_of[figure], pdf)
    pngs.append(png)
  write_toy_readme(runs, out, steps_of)
  return pngs


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--results", default="results", type=Path)
  parser.add_argument("--out", default="results/figures", type=Path)
  parser.add_argument("--pdf", action="store_true", help="also save PDFs")
  parser.add_argument("--datasets", nargs="+", default=None)
  parser.add_argument("--toy-only", action="store_true")
  parser.add_argument("--datasets-only", action="store_true")
  args = parser.parse_args(argv)
  if not args.toy_only:
    pngs = make_dataset_figures(args.results, args.out, args.datasets, args.pdf)
    if not pngs:
      print(f"no <problem>/<dataset>.npz under {args.results}: run experiments.table1 first")
  if not args.datasets_only:
    make_toy_figures(args.out / "toy", pdf=args.pdf)
  print(f"figures written to {args.out}")


if __name__ == "__main__":
  main()
