"""DP-SGD's sampler, step scale, clip and noise against independent math (issue 40, item 13).

The record-level DP stage (fedmpi/privacy/record_dp.py) replaces the local loop's batch
sampler and gradient. Each test computes what DP-SGD (Abadi et al. 2016, Alg. 1, with
Poisson sampling as the accountant assumes) must give, in plain torch/numpy, and each is
built to fail on one broken rule: shuffled batches instead of Poisson sampling, division by
the sampled batch size instead of the expected one, a per-sample factor not capped at 1, or
noise of std σ instead of σ·C.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from fedmpi.component import ClientTask
from fedmpi.config.schema import config_from_dict
from fedmpi.privacy.record_dp import RecordDP
from fedmpi.training.flat import FlatModel
from fedmpi.training.loop import StepHooks

B, CLIP = 50, 0.7


def stage(sigma: float, batch_size: int = B, clip: float = CLIP) -> RecordDP:
    cfg = config_from_dict({"privacy": {"dp": {"level": "record", "clip": clip,
                                               "noise_multiplier": sigma}},
                            "model": {"norm": "gn"}, "train": {"batch_size": batch_size}})
    return RecordDP(cfg)


def hooks(st: RecordDP, n: int = 1000, seed: int = 3) -> StepHooks:
    task = ClientTask(client=0, round=0, indices=torch.arange(n), seed=seed)
    return st.wrap_hooks(StepHooks(), task)


def test_batches_are_poisson_samples_of_rate_b_over_n():
    """Every sample joins a step independently with q = B/n: sizes vary as Binomial(n, q),
    each index is drawn with frequency q, and batches are not the shuffled epoch's slices."""
    n, steps = 1000, 3000
    h = hooks(stage(1.0), n)
    gen = torch.Generator().manual_seed(0)
    batches = list(h.sampler(torch.arange(n), steps, gen))
    assert len(batches) == steps
    q = B / n
    sizes = np.array([len(b) for b in batches])
    assert abs(sizes.mean() - n * q) < 5 * math.sqrt(n * q * (1 - q) / steps)
    assert abs(sizes.var() - n * q * (1 - q)) < 0.15 * n * q * (1 - q)
    counts = np.bincount(torch.cat(batches).numpy(), minlength=n)
    freq = counts / steps
    assert abs(freq.mean() - q) < 1e-3 and freq.std() < 4 * math.sqrt(q * (1 - q) / steps)
    assert all(len(set(b.tolist())) == len(b) for b in batches[:50])   # no repeats in a batch


def _model() -> FlatModel:
    torch.manual_seed(0)
    return FlatModel(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)))


def _per_sample_reference(flat: FlatModel, x: torch.Tensor, y: torch.Tensor, clip: float,
                          divisor: int) -> torch.Tensor:
    """(Σ_i g_i·min(1, C/‖g_i‖)) / B by one backward pass per sample."""
    total = torch.zeros(flat.num_params, dtype=torch.float64)
    for i in range(len(y)):
        flat.zero_grad()
        nn.functional.cross_entropy(flat.model(x[i:i + 1]), y[i:i + 1]).backward()
        g = flat.grad.double().clone()
        total += g * min(1.0, clip / float(g.norm()))
    return total / divisor


def test_the_gradient_is_the_clipped_sum_over_the_expected_batch_size():
    """σ = 0: the step's gradient is Σ_i clip(g_i) / B with B the *expected* batch size, the
    clip factor capped at 1 (small per-sample gradients keep their norm)."""
    flat = _model()
    torch.manual_seed(1)
    x = torch.randn(37, 6) * torch.tensor([0.01] * 20 + [5.0] * 17)[:, None]   # small and large
    y = torch.randint(0, 3, (37,))
    norms = []
    for i in range(len(y)):
        flat.zero_grad()
        nn.functional.cross_entropy(flat.model(x[i:i + 1]), y[i:i + 1]).backward()
        norms.append(float(flat.grad.norm()))
    clip = float(np.median(norms))           # half the samples below C, half above
    assert min(norms) < clip < max(norms)
    want = _per_sample_reference(flat, x, y, clip, B)
    flat.zero_grad()
    loss = hooks(stage(0.0, clip=clip)).gradient(flat, x, y)
    torch.testing.assert_close(flat.grad.double(), want, rtol=1e-5, atol=1e-7)
    ref_loss = nn.functional.cross_entropy(flat.model(x), y, reduction="sum")
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)


def test_the_noise_has_std_sigma_times_c_before_the_division():
    """σ > 0: the gradient minus its noiseless value, times B, is N(0, σ²C²) per coordinate."""
    torch.manual_seed(2)
    flat = FlatModel(nn.Sequential(nn.Linear(100, 100), nn.Tanh(), nn.Linear(100, 10)))
    x, y = torch.randn(8, 100), torch.randint(0, 10, (8,))
    sigma = 1.5
    flat.zero_grad()
    hooks(stage(0.0)).gradient(flat, x, y)
    quiet = flat.grad.double().clone()
    flat.zero_grad()
    hooks(stage(sigma)).gradient(flat, x, y)
    z = (flat.grad.double() - quiet) * B
    P = z.numel()
    se = sigma * CLIP / math.sqrt(2 * P)                   # std error of a sample std
    assert abs(float(z.std()) - sigma * CLIP) < 5 * se
    assert abs(float(z.mean())) < 5 * sigma * CLIP / math.sqrt(P)


def test_noise_streams_are_per_client_round_and_reproducible():
    """The noise of (seed, client, round) is the same every time it is drawn and differs
    between client-rounds (a resumed run draws the same noise)."""
    flat = _model()
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    grads = []
    for seed in (3, 3, 4):
        flat.zero_grad()
        hooks(stage(1.0), seed=seed).gradient(flat, x, y)
        grads.append(flat.grad.clone())
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])
