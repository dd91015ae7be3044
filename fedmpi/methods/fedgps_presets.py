"""FedGPS source presets (``algorithm.fedgps.preset``): the values of the keys on
which the FedGPS paper and the authors' code disagree, per source.

The table and the rule (explicit key > preset > built-in default) are in the
docstring of :mod:`fedmpi.methods.fedgps`.
"""
from __future__ import annotations

from typing import Any

__all__ = ["DEFAULTS", "PRESETS", "AUTHORS_MEAN", "AUTHORS_STD", "resolve_options"]

#: Built-in values of the preset-controlled keys (no preset, key null).
DEFAULTS: dict[str, Any] = {
    "norm": "global", "lambda1": 1.0, "surrogate_supcon": 0.1, "lambda2": 0.1,
    "align_labels": "class", "eval_logits": "first", "sign": "along",
    "first_participation": "none", "surrogate_augment": "none", "surrogate_normalize": "dataset"}
#: Each source's values (module docstring table).
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {"norm": "global", "lambda1": 0.1, "surrogate_supcon": 0.0, "lambda2": 0.2,
              "align_labels": "class", "eval_logits": "first", "sign": "against",
              "first_participation": "global", "surrogate_augment": "none",
              "surrogate_normalize": "dataset"},
    "authors": {"norm": "per_tensor_sum", "lambda1": 1.0, "surrogate_supcon": 0.1, "lambda2": 0.1,
                "align_labels": "shifted", "eval_logits": "all", "sign": "along",
                "first_participation": "none", "surrogate_augment": "crop_flip",
                "surrogate_normalize": "authors"},
}
#: the authors' surrogate normalisation (``transforms.Normalize(0.5, 0.25)``)
AUTHORS_MEAN, AUTHORS_STD = 0.5, 0.25


def resolve_options(params) -> dict[str, Any]:
    """Values of the preset-controlled keys of ``algorithm.fedgps`` (``params``, the
    block's :class:`~fedmpi.methods.fedgps.FedGPSParams`): an explicitly set
    (non-null) key wins, then the preset, then :data:`DEFAULTS`."""
    base = PRESETS.get(params.preset, DEFAULTS) if params.preset else DEFAULTS
    return {k: (getattr(params, k) if getattr(params, k) is not None else base[k])
            for k in DEFAULTS}
