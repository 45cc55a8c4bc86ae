"""Dolan-More performance profiles (Dolan and More, Math. Program. 91, 2002).

For problems p and solvers s with cost ``t[p, s]`` (gradient calls or seconds; ``inf`` where
s did not solve p), the ratio is ``r[p, s] = t[p, s] / min_s t[p, s]`` and the profile of s is
``rho_s(tau) = |{p : r[p, s] <= tau}| / (number of problems)``: ``rho_s(1)`` is the fraction
of problems where s is (one of) the best, ``rho_s(inf)`` the fraction it solves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np


def performance_ratios(costs) -> np.ndarray:
  """``r[p, s] = t[p, s] / min_s t[p, s]`` (inf where s failed, or where every solver failed)."""
  costs = np.asarray(costs, dtype=np.float64)
  if costs.ndim != 2:
    raise ValueError(f"costs must be (problems, solvers), got shape {costs.shape}")
  best = np.min(costs, axis=1, keepdims=True)
  with np.errstate(divide="ignore", invalid="ignore"):
    ratios = costs / best
  return np.where(np.isfinite(costs) & np.isfinite(best), ratios, np.inf)


def performance_profile(costs, taus) -> np.ndarray:
  """``rho[i, s]``: the fraction of problems with ``r[p, s] <= taus[i]``; shape (len(taus), S)."""
  ratios = performance_ratios(costs)
  taus = np.asarray(taus, dtype=np.float64)
  return np.mean(ratios[None, :, :] <= taus[:, None, None], axis=1)


def plot_profile(costs, solvers: Sequence[str], path: Path, title: str, xlabel: str):
  """Writes the profile as a PNG with log2(tau) on the x axis (a step per ratio)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ratios = performance_ratios(costs)
  finite = ratios[np.isfinite(ratios)]
  top = max(1.0, float(np.log2(finite.max())) if finite.size else 1.0) * 1.05 + 0.1
  log_taus = np.linspace(0.0, top, 600)
  rho = performance_profile(costs, 2.0**log_taus)
  fig, ax = plt.subplots(figsize=(9, 4.5))
  styles = ["-", "--", "-.", ":"]
  for s, name in enumerate(solvers):
    ax.step(log_taus, rho[:, s], where="post", label=name, ls=styles[(s // 10) % 4], lw=1.5)
  ax.set_xlim(0, top)
  ax.set_ylim(0, 1.02)
  ax.set_xlabel(xlabel)
  ax.set_ylabel("fraction of problems")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
