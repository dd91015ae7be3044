"""Secure aggregation (privacy.secure_aggregation, fedmpi/privacy/secagg.py).

References are computed here: the fixed-point code with numpy integers, the
masked protocol's outcome as the plain float64 sum, the run's model against a
plaintext run of the same config within the documented quantisation bound.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import run_fedmpi_many, run_here

pytest.importorskip("cryptography")

from fedmpi.privacy.secagg import MOD, RING_BITS, SecureAggregator, decode, encode, limit  # noqa: E402

F = 24


def _numpy_encode(x: np.ndarray, f: int) -> np.ndarray:
    q = np.round(x.astype(np.float64) * 2.0 ** f).astype(np.int64)
    return np.mod(q, 2 ** 48)


def test_fixed_point_code_against_numpy():
    x = np.random.default_rng(0).normal(scale=100.0, size=1000)
    x[:3] = [0.0, -2.0 ** (47 - F) + 1, 2.0 ** (47 - F) - 1]
    e = encode(torch.as_tensor(x), F)
    np.testing.assert_array_equal(e.numpy(), _numpy_encode(x, F))
    centred = np.where(e.numpy() >= 2 ** 47, e.numpy() - 2 ** 48, e.numpy())
    np.testing.assert_array_equal(decode(e, F).numpy(), centred / 2.0 ** F)
    assert np.max(np.abs(decode(e, F).numpy() - x)) <= 2.0 ** -(F + 1)
    assert RING_BITS == 48 and MOD == 2 ** 48
    assert limit(F, 4) == 2.0 ** (47 - F) / 4


def _ranks(layout: list[list[int]], K: int) -> list[SecureAggregator]:
    aggs = [SecureAggregator(hosted, K, F) for hosted in layout]
    words = sum(a.public_words() for a in aggs)          # what the key Allreduce computes
    for a in aggs:
        a.set_public(words)
    return aggs


def test_masks_cancel_and_what_rank0_receives_is_masked():
    """Three ranks: rank 0 hosts nobody, ranks 1 and 2 host clients {0, 2, 4} and {1, 3};
    client 3 was refused this round. Rank 0 receives the sealed buffers one per rank (the
    Gather of Comm.reduce_sum): each is uncorrelated with that rank's true partial sum,
    and their sum decodes to the float64 sum of the accepted clients' contributions."""
    K, D, t = 5, 20000, 7
    rng = np.random.default_rng(1)
    x = rng.normal(scale=0.05, size=(K, D))
    accepted = [0, 1, 2, 4]
    layout = [[], [0, 2, 4], [1, 3]]
    aggs = _ranks(layout, K)
    sealed = []
    for a, hosted in zip(aggs, layout):
        mine = [k for k in hosted if k in accepted]
        partial = torch.as_tensor(x[mine].sum(0) if mine else np.zeros(D))
        out = np.zeros(D, dtype=np.int64)
        a.seal(partial, t, mine, accepted, out)
        sealed.append(out)
        if mine:
            plain = _numpy_encode(partial.numpy(), F).astype(np.float64)
            assert abs(np.corrcoef(out.astype(np.float64), plain)[0, 1]) < 0.05
            assert abs(np.corrcoef(out.astype(np.float64), partial.numpy())[0, 1]) < 0.05
            # uniform on the ring: the mean of U[0, 2^48) is 2^47 ± a few standard errors
            assert abs(out.mean() / 2 ** 48 - 0.5) < 5 * (1 / np.sqrt(12 * D))
    total = aggs[0].open(np.sum(sealed, axis=0)).numpy()
    expected = x[accepted].sum(0)
    assert np.max(np.abs(total - expected)) <= 2 * 2.0 ** -(F + 1)   # one rounding per rank


@pytest.mark.parametrize("layout", [[[0, 1, 2, 3, 4, 5]], [[], [0, 2, 4, 5], [1, 3]],
                                    [[], [0, 1, 2], [3], [4, 5]]])
def test_sealing_skips_same_rank_pairs_bit_identically(layout):
    """E_r drawn over the cross-rank pairs only is, bit for bit, enc(S_r) + Σ_{k∈r} m_k with
    every pair's mask (m_k from ``mask``, each pair drawn); the sealed sum decodes to exactly
    what the ranks' plain float64 partial sums encode to; and with one rank hosting every
    accepted client (``-n 1``) no pair secret is derived at all."""
    K, D, t = 6, 5001, 3
    x = np.random.default_rng(2).normal(scale=0.3, size=(K, D))
    accepted = [0, 1, 2, 4, 5]
    aggs = _ranks(layout, K)
    sealed, plain = [], []
    for a, hosted in zip(aggs, layout):
        mine = [k for k in hosted if k in accepted]
        partial = torch.as_tensor(x[mine].sum(0) if mine else np.zeros(D))
        out = np.zeros(D, dtype=np.int64)
        a.seal(partial, t, mine, accepted, out)
        every_pair = _numpy_encode(partial.numpy(), F)
        for k in mine:
            every_pair = np.mod(every_pair + a.mask(k, t, accepted, D), MOD)
        np.testing.assert_array_equal(out, every_pair)
        sealed.append(out)
        plain.append(_numpy_encode(partial.numpy(), F))
    total = aggs[0].open(np.sum(sealed, axis=0))
    np.testing.assert_array_equal(total.numpy(), decode(torch.as_tensor(np.sum(plain, axis=0)), F).numpy())
    # any representative (a sum of ring elements), both halves of the ring
    reps = np.array([0, 1, MOD // 2 - 1, MOD // 2, MOD - 1, MOD, 3 * MOD - 2, 5 * MOD // 2 + 7],
                    dtype=np.int64)
    np.testing.assert_array_equal(aggs[0].open(reps.copy()).numpy(),
                                  decode(torch.as_tensor(reps), F).numpy())
    if len(layout) == 1:
        fresh = _ranks(layout, K)[0]
        out = np.zeros(D, dtype=np.int64)
        fresh.seal(torch.as_tensor(x[accepted].sum(0)), t, accepted, accepted, out)
        assert not fresh._pair
        np.testing.assert_array_equal(out, _numpy_encode(x[accepted].sum(0), F))


def test_masks_differ_per_round_and_need_every_accepted_pair():
    K, D = 4, 64
    aggs = _ranks([[0, 1], [2, 3]], K)
    m0 = aggs[0].mask(0, 1, [0, 1, 2, 3], D)
    assert not np.array_equal(m0, aggs[0].mask(0, 2, [0, 1, 2, 3], D))
    s = (aggs[0].mask(0, 1, [0, 1, 2, 3], D) + aggs[0].mask(1, 1, [0, 1, 2, 3], D)
         + aggs[1].mask(2, 1, [0, 1, 2, 3], D) + aggs[1].mask(3, 1, [0, 1, 2, 3], D))
    assert not np.mod(s, MOD).any()                       # all four: cancel exactly
    s3 = (aggs[0].mask(0, 1, [0, 1, 2, 3], D) + aggs[0].mask(1, 1, [0, 1, 2, 3], D)
          + aggs[1].mask(2, 1, [0, 1, 2, 3], D))
    assert np.mod(s3, MOD).any()                          # a missing survivor: no cancellation


def test_mask_is_the_documented_prg_computed_with_cryptography_here():
    """m_k = Σ_{j≠k} ±PRG(s_kj, t) mod 2^48 with s_kj = HKDF-SHA256(X25519(sk_k, pk_j),
    info "fedmpi secure aggregation min max") and PRG the AES-256-CTR keystream (nonce: t
    as 8 little-endian bytes, then 8 zero bytes) read as little-endian uint64 — rebuilt
    here from the public keys and cryptography's primitives; sizes change between calls
    (the module reuses a keystream scratch buffer)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    K = 4
    aggs = _ranks([[0, 1], [2, 3]], K)
    public = (sum(a.public_words() for a in aggs)).view(np.uint8).reshape(K, 32)
    private = {**aggs[0]._private, **aggs[1]._private}

    def prg(k: int, j: int, t: int, size: int) -> np.ndarray:
        shared = private[k].exchange(X25519PublicKey.from_public_bytes(bytes(public[j])))
        info = b"fedmpi secure aggregation %d %d" % (min(k, j), max(k, j))
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)
        enc = Cipher(algorithms.AES(key), modes.CTR(t.to_bytes(8, "little") + bytes(8))).encryptor()
        raw = np.frombuffer(enc.update(bytes(8 * size)), dtype="<u8")
        return (raw % np.uint64(MOD)).astype(object)

    for k, t, size, accepted in [(1, 3, 10, [0, 1, 2, 3]), (2, 3, 1001, [0, 2, 3]),
                                 (0, 9, 10, [0, 1, 3])]:
        expected = sum((prg(k, j, t, size) if k < j else -prg(k, j, t, size))
                       for j in accepted if j != k) % MOD
        owner = aggs[0] if k in (0, 1) else aggs[1]
        got = owner.mask(k, t, accepted, size)
        assert got.dtype == np.int64 and list(got) == list(expected), (k, t, size)


SMALL = ["--set", "train.rounds=1", "--set", "data.num_clients=6", "--set", "train.clients_per_round=4",
         "--set", "runtime.progress=false", "--set", "runtime.threads=1", "--set", "eval.sharded=false"]


def _state(out) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", map_location="cpu", weights_only=True)


@pytest.mark.parametrize("n", [1, pytest.param(3, marks=pytest.mark.mpi)])
def test_secure_run_equals_plaintext_within_the_quantisation_bound(tmp_path, n):
    """One round: θ_secure − θ_plain per coordinate ≤ W·2^-(f+1) / Σ w̃_k (plus float32
    rounding of θ), W ≤ 2 ranks holding clients."""
    runs = {name: ["run", "configs/quickstart.yaml", *SMALL, *extra, "--out", str(tmp_path / name)]
            for name, extra in (("plain", []),
                                ("secure", ["--set", "privacy.secure_aggregation=true"]))}
    outs = {name: tmp_path / name for name in runs}
    if n == 1:
        for argv in runs.values():
            run_here(argv)                     # alone: in this process
    else:
        run_fedmpi_many(list(runs.values()), n=n)   # both runs, one launch
    a, b = _state(outs["plain"]), _state(outs["secure"])
    from fedmpi.log.reader import read

    log = read(outs["secure"] / "log.h5")
    w = log.clients.get("weight")
    bound = 2 * 2.0 ** -(F + 1) / 0.2 + 1e-6     # Σ w̃_k ≥ 0.2 for 4 of 6 digits clients
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a
                if a[k].is_floating_point())
    assert worst <= bound, (worst, bound, w)
    assert log.attrs["status"] == "completed"


def test_out_of_range_update_is_refused_not_wrapped(tmp_path):
    """A client scaling its update by 1e9 exceeds 2^(47-f)/m: excluded with its reason, and
    the global model stays finite and close to the plaintext run without that client."""
    out = tmp_path / "run"
    run_here(["run", "configs/quickstart.yaml", *SMALL, "--set", "privacy.secure_aggregation=true",
              "--set", "adversary.clients=[0,1,2,3,4,5]", "--set", "adversary.kind=scale",
              "--set", "adversary.factor=1e9", "--out", str(out)])
    from fedmpi.log.reader import read

    log = read(out / "log.h5")
    texts = [str(m) for m in log.events["message"]]
    assert any("secure-aggregation range" in m for m in texts), texts


@pytest.mark.parametrize("extra,keys", [
    (["aggregation.weighting=fedvg"], "'aggregation.weighting'"),
    (["runtime.reduction=exact"], "'runtime.reduction'"),
    (["ecgr.enabled=true"], "'ecgr.enabled'"),
    (["aggregation.rule=examples.trimmed_mean_rule:TrimmedMean"], "'aggregation.rule'"),
])
def test_illegal_combinations_exit_2_naming_both_keys(extra, keys, capsys):
    args = ["check", "configs/quickstart.yaml", "--set", "privacy.secure_aggregation=true"]
    for e in extra:
        args += ["--set", e]
    capsys.readouterr()
    assert run_here(args, check=False) == 2
    err = capsys.readouterr().err
    assert "'privacy.secure_aggregation'" in err and keys in err
    assert len(err.strip().splitlines()) == 1


def test_per_client_statistics_of_a_method_are_refused_at_build(tmp_path, capsys):
    assert run_here(["run", "configs/quickstart.yaml", *SMALL, "--set",
                     "privacy.secure_aggregation=true", "--set", "algorithm.name=fednova",
                     "--out", str(tmp_path / "r")], check=False) == 2
    assert "'privacy.secure_aggregation' and 'algorithm.name'" in capsys.readouterr().err
