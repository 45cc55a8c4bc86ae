"""A benchmark of what users get: CUTEst, LIBSVM (several x0, float64 and float32), user problems.

``python -m experiments.benchmark --suite cutest libsvm libsvm32 user --solvers ...`` runs every
solver on every problem under one protocol (``runner``), appends one CSV row per (problem,
solver, seed) and writes ``summary.md`` with solved counts and Dolan-More performance profiles
(``profiles``). Suites are in ``suites``, the solver registry in ``solvers``.
"""
