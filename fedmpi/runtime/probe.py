"""The dry run: one rank's built run exercised on a batch before anything is written (issue 26).

``fedmpi check --dry-run CONFIG`` and every ``fedmpi run`` (before the run directory
is created) build each rank as a run does — data, model, method, weighting,
transforms (:func:`fedmpi.runtime.build.build`) — and then, on every rank:

* one forward/backward batch (``train.batch_size`` samples, in partition order) of
  each hosted client through the model, with the training loss;
* one evaluation batch (``eval.batch_size``) of the test set where the rank holds it;
* the model's output checked against the classes (:func:`check_outputs`).

The batches change nothing: the model's buffers (the only state a forward and backward
pass changes) and the global RNG states are restored afterwards, gradients zeroed, so a
run with the dry run trains bit-identically to one without. A failure is an error line naming ``model.name``
(:class:`~fedmpi.errors.UserCodeError` or :class:`~fedmpi.errors.ConfigError`,
exit 2) agreed on by every rank, and no run directory exists yet.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fedmpi.errors import ConfigError
from fedmpi.imports import blame, code_path
from fedmpi.runtime.build import Built

if TYPE_CHECKING:
    from fedmpi.config.core import Config

__all__ = ["check_outputs", "dry_run", "probe_loss"]


def check_outputs(out: object, batch: int, want: int, num_classes: int, model: str) -> None:
    """The model's output for a batch of ``batch`` samples must be ``[batch, want]``
    logits (``want``: the method's width for ``num_classes`` classes, e.g. C, or 2C for
    FedGPS), whatever ``train.loss``: ``cross_entropy`` is a softmax over one logit per
    class, ``bce_logits`` one sigmoid per class (:mod:`fedmpi.training.optim`), and the accuracy,
    balanced accuracy, macro-F1 and AUROC of the log read the same C columns. A wider
    output would silently train on classes that do not exist; one logit for a binary
    task (the sigmoid habit) is refused too, naming ``model.name``."""
    where = f"config key 'model.name' ({model})"
    if not isinstance(out, torch.Tensor):
        raise ConfigError(f"{where}: the model returned {type(out).__name__}, expected a "
                          f"tensor of logits [batch, {want}]")
    if out.ndim != 2 or out.shape[0] != batch:
        raise ConfigError(f"{where}: the model returns outputs of shape {tuple(out.shape)} for a "
                          f"batch of {batch}; expected [{batch}, {want}] (one logit per class)")
    width = int(out.shape[1])
    if width == want:
        return
    hint = ("; one sigmoid logit for a binary task is not supported: return one logit per "
            "class (train.loss: bce_logits trains a sigmoid on each)"
            if width == 1 and num_classes == 2 else "")
    raise ConfigError(f"{where}: the model returns {width} output{'s' * (width != 1)} per "
                      f"sample but the data has {num_classes} classes; expected {want} (the "
                      f"model is called as factory(input_shape, num_classes): use num_classes "
                      f"for the last layer){hint}")


def probe_loss(out: torch.Tensor, y: torch.Tensor, cfg: Config) -> torch.Tensor:
    """The training loss of the dry run's batch: ``train.loss`` as local training computes
    it (:func:`fedmpi.training.optim.training_loss`, without class weights)."""
    from fedmpi.training.optim import training_loss

    return training_loss(out.float(), y, str(cfg.train.loss), None,
                         float(cfg.train.label_smoothing))


def dry_run(b: Built, model: Any = None) -> int:
    """Run the checks of the module docstring on this rank; returns the number of
    batches run. ``model``: the factory given to :func:`fedmpi.run` (None: ``model.name``)."""
    obj = model if model is not None else b.cfg.model.name
    name = code_path(obj) or str(b.cfg.model.name)
    want = b.num_outputs
    net, data, accel = b.flat.model, b.data, b.accel
    # a training-mode forward changes the buffers (BatchNorm statistics), restored after;
    # the backward pass only writes gradients, zeroed after (no copy of the parameters,
    # which may be most of the memory)
    saved = {name: v.detach().clone() for name, v in net.named_buffers()}
    devices = [b.device] if b.device.type == "cuda" else []
    was_training = net.training
    batches = 0
    try:
        with torch.random.fork_rng(devices=devices):
            net.train()
            gen = torch.Generator(device=b.device).manual_seed(0)
            for k in b.hosted:
                idx = torch.as_tensor(b.partition.client_indices[k][: b.cfg.train.batch_size],
                                      device=b.device)
                if idx.numel() == 0:
                    continue
                x = accel.input(data.prepare(data.x_train[idx], train=True, generator=gen))
                y = data.y_train[idx]
                with blame("model.name", obj), accel.autocast_context():
                    out = b.forward(x)
                check_outputs(out, idx.numel(), want, data.num_classes, name)
                with blame("model.name", obj):
                    b.flat.zero_grad()
                    probe_loss(out, y, b.cfg).backward()
                batches += 1
            n_test = min(int(data.y_test.numel()), b.cfg.eval.batch_size)
            if n_test:
                net.eval()
                x = accel.input(data.prepare(data.x_test[:n_test], train=False))
                with torch.no_grad(), blame("model.name", obj), accel.autocast_context():
                    out = b.forward(x)
                check_outputs(out, n_test, want, data.num_classes, name)
                batches += 1
    finally:
        if b.hosted:
            b.flat.zero_grad()
        with torch.no_grad():
            for name, v in net.named_buffers():
                v.copy_(saved[name])
        net.train(was_training)
    return batches
