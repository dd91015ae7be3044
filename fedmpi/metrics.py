r"""Test metrics of the global model (``eval.metrics``), logged per round as ``/rounds/<metric>``.

==================  ===========================================================  ============
name                definition (scikit-learn)                                    from
==================  ===========================================================  ============
accuracy            :math:`\frac{1}{n}\sum_i [\hat y_i = y_i]` — always logged,   confusion
                    as ``test_accuracy``
balanced_accuracy   mean over classes present in the test set of the recall       confusion
                    :math:`TP_c / n_c` (``balanced_accuracy_score``)
macro_f1            mean over the labels present in :math:`y \cup \hat y` of      confusion
                    :math:`F1_c = 2TP_c / (2TP_c + FP_c + FN_c)`
                    (``f1_score(average="macro")``)
auroc               area under the ROC curve of the softmax probabilities:        probabilities
                    binary: of class 1 (``roc_auc_score``); multi-class:
                    one-vs-rest, macro average (``multi_class="ovr"``); NaN when
                    the test set holds a single class
==================  ===========================================================  ============

The first three are functions of the confusion matrix :math:`M_{c,p}` (true
class :math:`c`, predicted :math:`p`), which is a *sum over samples*: sharded
evaluation (``eval.sharded``) reduces the slices' matrices with the loss in one
``Reduce`` and gets exactly the single-rank answer. AUROC needs every sample's
probabilities in one place, so a run that asks for it evaluates on rank 0 only
(:func:`shardable`). The matrix is expanded back into (true, predicted) pairs
and handed to scikit-learn, so the definitions are scikit-learn's. Predictions
outside the C classes (FedGPS ``eval_logits: all`` predicting a surrogate class)
fall into one extra column :math:`p = C`: wrong for every class.

**Your own metrics.** An ``eval.metrics`` item ``"pkg.module:fn"`` names a
function ``fn(labels [n] int64, probabilities [n, C] float64) -> float`` (the
softmax of the C class outputs, scikit-learn's ``y_true, y_score`` habit; an
AUPRC, a sensitivity at a fixed specificity, a Brier score). It is logged as
``/rounds/fn`` (the last component of the path) and reported like AUROC: it
needs every sample's probabilities, so it evaluates on rank 0 only, and
per site (``eval.where: clients``) it is computed on each site and combined
as the sample-weighted mean (:mod:`fedmpi.runtime.evaluation`).
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Callable, Sequence

import numpy as np
import torch

__all__ = ["METRICS", "Collector", "confusion_size", "metric_name", "nan_scalars", "scalars",
           "shardable", "score_metrics"]

METRICS = ("accuracy", "balanced_accuracy", "macro_f1", "auroc")
#: names a user metric may not take: the built-ins and the other /rounds scalars
RESERVED = METRICS + ("test_loss", "test_accuracy", "train_loss")


def is_user_metric(metric: str) -> bool:
    """Whether an ``eval.metrics`` item is an import path ``pkg.module:fn``."""
    return ":" in metric


def metric_name(metric: str) -> str:
    """The ``/rounds`` name of an ``eval.metrics`` item: ``pkg.mod:auprc`` → ``auprc``."""
    return metric.rsplit(":", 1)[-1].rsplit(".", 1)[-1] if is_user_metric(metric) else metric


def score_metrics(metrics: Sequence[str]) -> list[str]:
    """The chosen metrics that need every sample's probabilities (AUROC, user metrics):
    not functions of the confusion matrix, so neither sharded nor pooled across sites."""
    return [m for m in metrics if m == "auroc" or is_user_metric(m)]


@functools.lru_cache(maxsize=None)
def user_metric(path: str) -> Callable[[np.ndarray, np.ndarray], float]:
    """The function an ``eval.metrics`` import path names (ConfigError naming the key)."""
    from fedmpi.errors import ConfigError
    from fedmpi.imports import accepts, resolve

    fn = resolve(path, "eval.metrics", "a function (labels, probabilities) -> float")
    if not callable(fn) or not accepts(fn, 2):
        raise ConfigError(f"config key 'eval.metrics': {path!r} is not a function "
                          "(labels, probabilities) -> float")
    return fn


def confusion_size(num_classes: int) -> int:
    """Entries of the ``[C, C + 1]`` confusion matrix (last column: any prediction ≥ C)."""
    return num_classes * (num_classes + 1)


def shardable(metrics: Sequence[str]) -> bool:
    """Whether every metric is a function of the confusion matrix (sum-reducible)."""
    return not score_metrics(metrics)


def extra_names(metrics: Sequence[str]) -> list[str]:
    """The ``/rounds/<metric>`` names beyond ``test_accuracy``."""
    return [metric_name(m) for m in metrics if m != "accuracy"]


def nan_scalars(metrics: Sequence[str]) -> dict[str, float]:
    """The row of a round without evaluation."""
    return {"test_loss": math.nan, "test_accuracy": math.nan,
            **{m: math.nan for m in extra_names(metrics)}}


class Collector:
    """Accumulates, batch by batch, the confusion matrix and (for AUROC) the
    probabilities of the first C outputs; pass as ``collect`` to
    :func:`fedmpi.training.loop.evaluate`."""

    def __init__(self, num_classes: int, metrics: Sequence[str], device: torch.device) -> None:
        self.C = int(num_classes)
        self.metrics = tuple(metrics)
        self.confusion = torch.zeros(confusion_size(self.C), dtype=torch.int64, device=device)
        self.keep_probs = bool(score_metrics(self.metrics))
        self.probs: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> None:
        C = self.C
        pred = out.argmax(1).clamp_(max=C)
        self.confusion += torch.bincount(y * (C + 1) + pred, minlength=self.confusion.numel())
        if self.keep_probs:
            self.probs.append(torch.softmax(out[:, :C].float(), dim=1).cpu())
            self.labels.append(y.cpu())

    def scalars(self, loss_sum: float, n: int) -> dict[str, float]:
        """``test_loss``, ``test_accuracy`` and the other chosen metrics."""
        probs = (torch.cat(self.probs).double().numpy(), torch.cat(self.labels).numpy()) \
            if self.keep_probs and self.probs else None
        return scalars(loss_sum, n, self.confusion.cpu().numpy(), self.C, self.metrics, probs)


def scalars(loss_sum: float, n: float, confusion: np.ndarray, num_classes: int,
            metrics: Sequence[str], probs: "tuple[np.ndarray, np.ndarray] | None" = None
            ) -> dict[str, float]:
    """Metrics from the summed loss, the flat ``[C, C + 1]`` confusion matrix and
    (AUROC) ``(probabilities [n, C], labels [n])``. scikit-learn is imported only for a
    metric that needs it (importing it costs about a CPU second)."""
    C = int(num_classes)
    m = np.rint(np.asarray(confusion, dtype=np.float64)).astype(np.int64).reshape(C, C + 1)
    n = int(n)
    out = {"test_loss": loss_sum / n if n else math.nan,
           "test_accuracy": float(np.trace(m[:, :C])) / n if n else math.nan}
    true, pred = np.nonzero(m)
    y_true, y_pred = np.repeat(true, m[true, pred]), np.repeat(pred, m[true, pred])
    for metric in metrics:
        if metric == "accuracy":
            continue
        name = metric_name(metric)
        if n == 0:
            out[name] = math.nan
        elif is_user_metric(metric):
            out[name] = _user(metric, *probs) if probs is not None else math.nan
        elif name == "balanced_accuracy":
            from sklearn.metrics import balanced_accuracy_score

            with warnings.catch_warnings():   # "y_pred contains classes not in y_true": expected
                warnings.simplefilter("ignore", UserWarning)
                out[name] = float(balanced_accuracy_score(y_true, y_pred))
        elif name == "macro_f1":
            from sklearn.metrics import f1_score

            out[name] = float(f1_score(y_true, y_pred, average="macro", zero_division=0))
        elif name == "auroc":
            out[name] = _auroc(*probs) if probs is not None else math.nan
    return out


def _user(path: str, p: np.ndarray, y: np.ndarray) -> float:
    """A user metric on (labels, probabilities), as a float (an error names the function)."""
    fn = user_metric(path)
    try:
        return float(fn(y, p))
    except Exception as exc:  # noqa: BLE001 - user code: say whose it was
        raise RuntimeError(f"eval.metrics {path!r} failed: {type(exc).__name__}: {exc}") from exc


def _auroc(p: np.ndarray, y: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    present = np.unique(y)
    if present.size < 2:
        return math.nan
    if p.shape[1] == 2:
        return float(roc_auc_score(y, p[:, 1]))
    if present.size < p.shape[1]:   # OvR over the classes present: renormalise their scores
        q = p[:, present] / p[:, present].sum(1, keepdims=True)
        return float(roc_auc_score(np.searchsorted(present, y), q if present.size > 2 else q[:, 1],
                                   **({"multi_class": "ovr", "average": "macro"}
                                      if present.size > 2 else {})))
    return float(roc_auc_score(y, p, multi_class="ovr", average="macro"))
