"""Minibatch training of a small MLP: HDM against Adam, SGD and optax's tuning-free family.

    python -m experiments.minibatch [--epochs 20] [--batch-size 64] [--seeds 0,1,2]
                                    [--sgd-lr 0.1] [--dtype float32] [--out results]

The MLP 64-32-32-10 (tanh, softmax cross-entropy, mean over the batch) is trained
on scikit-learn's digits (1797 8x8 images scaled to [0, 1]; 75% train, 25% test,
split with the seed). Each method sees the same stream of shuffled batches of 64
(the last, smaller batch of each pass is dropped, so one program serves every
batch) and gets the same budget of gradient calls: ``--epochs`` times the batches
per pass. One call is one ``jax.value_and_grad`` of the batch loss; an HDM step
costs two (the current point and the trial point, both on the current batch,
through ``hdm_optax.minibatch_step``), Adam and SGD one. After every
"epoch" of gradient calls (batches-per-pass calls) it records the full-batch
training loss and the test accuracy.

Methods, each as a user calls it: ``hdm_optax.hdm_best()`` (its defaults, L probed
on the first batch), ``hdm_best(precond_lr=eta)`` for each ``--precond-lrs`` value,
``hdm_optax.hdm_auto()``, ``hdm_optax.osgm_best()``, ``optax.adam(1e-3)``,
``optax.sgd(--sgd-lr)``, ``optax.contrib.prodigy()``, ``optax.contrib.dog()`` and
``optax.contrib.dadapt_adamw()`` (their defaults); and, for the record, the loop that
reuses the cached value and gradient across batches
(``optax.value_and_grad_from_state``, one call a step): its null steps are printed.
Every method runs through ``hdm_optax.minibatch_step``, which counts the calls of
its steps (an HDM step's trial point and probes included).

Writes ``<out>/minibatch.csv`` (one row per method, seed and epoch) and
``<out>/minibatch.png`` (mean over the seeds, shaded min-max), and prints a
table of the final values.
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hdm_optax

LAYERS = (64, 32, 32, 10)


class Data(NamedTuple):
  x_train: jax.Array
  y_train: jax.Array
  x_test: jax.Array
  y_test: jax.Array


def load_digits(seed: int, dtype) -> Data:
  from sklearn.datasets import load_digits as sk_load_digits

  x, y = sk_load_digits(return_X_y=True)
  order = np.random.default_rng(seed).permutation(len(y))
  x, y = (x[order] / 16.0).astype(dtype), y[order].astype(np.int32)
  n_train = int(0.75 * len(y))
  return Data(
    jnp.asarray(x[:n_train]),
    jnp.asarray(y[:n_train]),
    jnp.asarray(x[n_train:]),
    jnp.asarray(y[n_train:]),
  )


def init_mlp(seed: int, dtype) -> list:
  """Weights ~ N(0, 1/fan_in), biases 0."""
  keys = jax.random.split(jax.random.key(seed), len(LAYERS) - 1)
  return [
    (
      jax.random.normal(k, (m, n), dtype) / np.sqrt(m).astype(dtype),
      jnp.zeros(n, dtype),
    )
    for k, m, n in zip(keys, LAYERS[:-1], LAYERS[1:])
  ]


def logits(params, x):
  for w, b in params[:-1]:
    x = jnp.tanh(x @ w + b)
  w, b = params[-1]
  return x @ w + b


def loss_fn(params, batch):
  x, y = batch
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y))


@jax.jit
def evaluate(params, data: Data):
  train_loss = loss_fn(params, (data.x_train, data.y_train))
  accuracy = jnp.mean(jnp.argmax(logits(params, data.x_test), -1) == data.y_test)
  return train_loss, accuracy


def batch_stream(data: Data, batch_size: int, seed: int):
  """Shuffled batches of ``batch_size``, pass after pass (the remainder dropped)."""
  rng = np.random.default_rng(seed + 1)
  n = data.x_train.shape[0]
  while True:
    order = rng.permutation(n)
    for i in range(0, n - batch_size + 1, batch_size):
      idx = order[i : i + batch_size]
      yield data.x_train[idx], data.y_train[idx]


def stale_cache_step(optimizer):
  """The broken loop: the cached value and gradient of the previous batch are reused."""

  @jax.jit
  def step(params, state, batch):
    value_fn = lambda p: loss_fn(p, batch)
    # value_and_grad_from_state evaluates only while the cached value is +inf.
    calls = jnp.where(jnp.isfinite(optax.tree.get(state, "value")), 1, 2)
    value, grad = optax.value_and_grad_from_state(value_fn)(params, state=state)
    updates, state = optimizer.update(
      grad, state, params, value=value, grad=grad, value_fn=value_fn
    )
    return optax.apply_updates(params, updates), state, hdm_optax.MinibatchStats(value, calls)

  return step


def train(step, optimizer, data, params, *, budget, per_epoch, batch_size, seed):
  """Runs ``step`` until ``budget`` gradient calls; one record per ``per_epoch`` calls."""
  state = optimizer.init(params)
  stream = batch_stream(data, batch_size, seed)
  calls, batches, rows = 0, 0, []
  loss0, acc0 = evaluate(params, data)
  rows.append((0, 0, 0.0, float(loss0), float(acc0), 0))
  start = time.perf_counter()
  while calls < budget:
    params, state, stats = step(params, state, next(stream))
    calls += int(stats.grad_evals)
    batches += 1
    if calls >= per_epoch * len(rows) or calls >= budget:
      train_loss, acc = evaluate(params, data)
      nulls = optax.tree.get(state, "num_null_steps")
      rows.append(
        (
          len(rows),
          calls,
          batches * batch_size / data.x_train.shape[0],
          float(train_loss),
          float(acc),
          -1 if nulls is None else int(nulls),
        )
      )
  return rows, time.perf_counter() - start


def methods(sgd_lr, precond_lrs):
  """name -> (optimizer, step or None for ``minibatch_step``)."""
  hdm = hdm_optax.hdm_best()
  out = {"hdm_best()": (hdm, None)}
  for lr in precond_lrs:
    out[f"hdm_best(precond_lr={lr:g})"] = (hdm_optax.hdm_best(precond_lr=lr), None)
  out["hdm_auto()"] = (hdm_optax.hdm_auto(), None)
  out["osgm_best()"] = (hdm_optax.osgm_best(), None)
  out["adam(1e-3)"] = (optax.adam(1e-3), None)
  out[f"sgd({sgd_lr:g})"] = (optax.sgd(sgd_lr), None)
  out["prodigy()"] = (optax.contrib.prodigy(), None)
  out["dog()"] = (optax.contrib.dog(), None)
  out["dadapt_adamw()"] = (optax.contrib.dadapt_adamw(), None)
  out["hdm_best(), stale cache"] = (hdm, stale_cache_step(hdm))
  return out


def plot(records, path, per_epoch):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for name in dict.fromkeys(r["method"] for r in records):
    rows = [r for r in records if r["method"] == name]
    seeds = sorted({r["seed"] for r in rows})
    by_seed = [[r for r in rows if r["seed"] == s] for s in seeds]
    length = min(len(b) for b in by_seed)
    x = np.mean([[r["grad_calls"] for r in b[:length]] for b in by_seed], 0) / per_epoch
    style = "--" if "stale" in name else "-"
    for ax, key in zip(axes, ("train_loss", "test_acc")):
      y = np.array([[r[key] for r in b[:length]] for b in by_seed])
      (line,) = ax.plot(x, y.mean(0), style, label=name)
      ax.fill_between(x, y.min(0), y.max(0), color=line.get_color(), alpha=0.2)
  axes[0].set_yscale("log")
  axes[0].set_ylabel("full-batch training loss")
  axes[1].set_ylabel("test accuracy")
  for ax in axes:
    ax.set_xlabel(f"gradient calls / {per_epoch} (epochs of Adam or SGD)")
    ax.grid(alpha=0.3)
  axes[1].legend()
  fig.suptitle("MLP 64-32-32-10 on digits, batches of 64 (mean of seeds, min-max shaded)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--epochs", type=int, default=20)
  p.add_argument("--batch-size", type=int, default=64)
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--sgd-lr", type=float, default=0.1)
  p.add_argument(
    "--precond-lrs", default="1e-2", help="eta_p of extra hdm_best runs (comma-separated)"
  )
  p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
  p.add_argument("--out", default="results")
  args = p.parse_args(argv)
  if args.dtype == "float64":
    jax.config.update("jax_enable_x64", True)
  dtype = np.dtype(args.dtype)
  precond_lrs = [float(v) for v in args.precond_lrs.split(",") if v]
  records = []
  for seed in (int(s) for s in args.seeds.split(",")):
    data = load_digits(seed, dtype)
    per_epoch = data.x_train.shape[0] // args.batch_size
    budget = args.epochs * per_epoch
    params0 = init_mlp(seed, dtype)
    for name, (optimizer, step) in methods(args.sgd_lr, precond_lrs).items():
      step = step or hdm_optax.minibatch_step(optimizer, loss_fn)
      rows, seconds = train(
        step,
        optimizer,
        data,
        params0,
        budget=budget,
        per_epoch=per_epoch,
        batch_size=args.batch_size,
        seed=seed,
      )
      for epoch, calls, passes, train_loss, acc, nulls in rows:
        records.append(
          dict(
            method=name,
            seed=seed,
            epoch=epoch,
            grad_calls=calls,
            data_passes=round(passes, 3),
            train_loss=train_loss,
            test_acc=acc,
            null_steps=nulls,
          )
        )
      last = rows[-1]
      print(
        f"seed {seed}  {name:<24} calls {last[1]:>4}  passes {last[2]:5.2f}  "
        f"train loss {last[3]:.4f}  test acc {last[4]:.4f}  "
        f"null steps {last[5] if last[5] >= 0 else '-':>4}  ({seconds:.1f} s with compilation)"
      )
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "minibatch.csv"), "w", newline="") as fh:
    writer = csv.DictWriter(fh, fieldnames=list(records[0]))
    writer.writeheader()
    writer.writerows(records)
  print(f"\n{'method':<24} {'train loss (mean, min-max)':>30} {'test acc (mean, min-max)':>28}")
  for name in dict.fromkeys(r["method"] for r in records):
    finals = [
      max((r for r in records if r["method"] == name and r["seed"] == s), key=lambda r: r["epoch"])
      for s in {r["seed"] for r in records}
    ]
    loss = [r["train_loss"] for r in finals]
    acc = [r["test_acc"] for r in finals]
    print(
      f"{name:<24} {np.mean(loss):>12.4f} ({min(loss):.4f}-{max(loss):.4f}) "
      f"{np.mean(acc):>12.4f} ({min(acc):.4f}-{max(acc):.4f})"
    )
  plot(records, os.path.join(args.out, "minibatch.png"), per_epoch)
  print(f"wrote {args.out}/minibatch.csv and {args.out}/minibatch.png")


if __name__ == "__main__":
  main()
