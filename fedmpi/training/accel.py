"""Opt-in speed switches for the local training and evaluation forward pass.

Three ``runtime.*`` keys, all off by default because each one changes
floating-point results (never the algorithm):

``runtime.autocast: bf16``
    The forward pass and the loss run under ``torch.autocast(dtype=bfloat16)``.
    Parameters, gradients and the flat state stay float32 (master weights), so
    every uplink/downlink and aggregation is unchanged; only the matmul/conv
    inputs are rounded to bf16's 8-bit mantissa.
``runtime.channels_last: true``
    Input batches are laid out NHWC. The parameters cannot be: they are views
    into the contiguous flat vector (:mod:`fedmpi.training.flat`). cuDNN picks the NHWC
    kernels when either operand is channels-last and converts the (small)
    weights itself; activations, the large tensors, stay NHWC throughout.
``runtime.compile: true``
    The model's forward is wrapped in :func:`torch.compile` (``runtime.compile_mode``).
    The flat parameter views keep fixed addresses, which is what CUDA graphs
    (``reduce-overhead``) need. A partial last batch triggers one recompilation
    for the other batch size.

The switches are meant for GPU runs; on CPU they work (tests exercise them there)
but rarely pay: bf16 convolutions and inductor-compiled kernels are usually
slower than fp32 oneDNN on CPU. ``bench/round_overhead.py --set runtime.autocast=bf16
...`` measures them against a plain loop with the same switches. On an H100 they did
not pay for ResNet-18 at 32×32 either (launch-bound; README "Performance").
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager

import torch
from torch import nn

if TYPE_CHECKING:
    from fedmpi.config.framework import RuntimeConfig

AUTOCAST_DTYPES = {"off": None, "bf16": torch.bfloat16}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class Accel:
    """The three switches, resolved for one device."""

    device_type: str = "cpu"
    autocast: str = "off"
    channels_last: bool = False
    compile: bool = False
    compile_mode: str = "default"

    @classmethod
    def from_config(cls, runtime: RuntimeConfig, device: torch.device) -> "Accel":
        """From the ``runtime`` config section."""
        return cls(device_type=device.type, autocast=runtime.autocast,
                   channels_last=runtime.channels_last, compile=runtime.compile,
                   compile_mode=runtime.compile_mode)

    @property
    def enabled(self) -> bool:
        return self.autocast != "off" or self.channels_last or self.compile

    def autocast_context(self) -> ContextManager:
        """``torch.autocast`` for ``runtime.autocast``, else a no-op context."""
        dtype = AUTOCAST_DTYPES[self.autocast]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=dtype)

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """Lay a 4-D image batch out channels-last when the switch is on."""
        if self.channels_last and x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x

    def wrap(self, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """The callable to run the forward with: ``torch.compile(model)`` or ``model``.

        The compiled wrapper shares the model's parameters (the flat views), so
        loading a new state into the :class:`~fedmpi.training.flat.FlatModel` is seen by it.
        """
        if not self.compile:
            return model
        return torch.compile(model, mode=None if self.compile_mode == "default" else self.compile_mode)


OFF = Accel()


def set_deterministic(on: bool) -> None:
    """``runtime.deterministic``: the same inputs give bit-identical results on GPU.

    Deterministic cuDNN/cuBLAS kernels (``torch.use_deterministic_algorithms``,
    warning-only where an op has no deterministic CUDA kernel, e.g. adaptive
    average pooling's backward), no cuDNN autotuning and no TF32 — PyTorch lets
    cuDNN convolutions use TF32 (10-bit mantissa) by default. On CPU results are
    already deterministic for a fixed thread count; this costs GPU speed, so it is
    off by default and meant for world-size invariance checks and debugging.
    """
    if not on:
        return
    # cuBLAS reads this when its first handle is created, which is after this call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
