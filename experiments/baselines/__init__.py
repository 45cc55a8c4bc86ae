"""The paper's baselines: first-order methods as optax transformations, SciPy quasi-Newton."""
