r"""Secure aggregation by pairwise masking (``privacy.secure_aggregation: true``).

Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine
Learning", CCS 2017, §3–4 — the masking protocol without its secret-sharing
recovery: the metadata ``Allreduce`` of a round tells every rank which
participants survived *before* any update is sent, so masks are drawn only
between survivors and cancel exactly; a client that fails after that point
aborts the round, as it does without secure aggregation.

**Encoding.** Each worker r holds the float64 partial sum S_r = Σ_{k∈r} w̃_k x_k
of its accepted clients (``weighted`` statistics; ``sum`` ones with weight 1) and
sends

.. math:: E_r = \mathrm{enc}(S_r) + \sum_{k \in r} m_k \pmod{2^{b}},\qquad
          \mathrm{enc}(v) = \mathrm{round}(v\,2^{f}) \bmod 2^{b},

with ring size 2^b (b = :data:`RING_BITS` = 48, so Σ over up to 2^15 ranks of
int64 values below 2^48 never overflows int64) and ``privacy.secagg.scale_bits``
f fractional bits. The pairwise masks

.. math:: m_k = \sum_{j \in A_t, j \ne k} \sigma_{kj}\, \mathrm{PRG}(s_{kj}, t) \pmod{2^{b}},
          \qquad \sigma_{kj} = +1 \text{ if } k < j \text{ else } -1,

over the round's accepted participants A_t sum to 0 mod 2^b, so rank 0 gets
Σ_r E_r = Σ_r enc(S_r) mod 2^b and decodes the centred value ÷ 2^f. Each E_r is
uniformly distributed in the ring for anyone without the pair secrets s_kj,
i.e. rank 0 only ever holds the sum over all accepted clients. Within Σ_{k∈r} m_k
the terms of two clients both on rank r cancel, so a rank draws only the pairs
that cross to another rank (:meth:`SecureAggregator.seal`): a worker sees its own
clients in the clear anyway.

**Keys and PRG** (the ``cryptography`` package, extra ``.[privacy]``): every client
holds an X25519 key pair made at start-up; the public keys travel to every rank
(one metadata ``Allreduce``); s_kj = HKDF-SHA256 of the X25519 shared secret;
PRG(s, t) is the AES-256-CTR keystream under key s with the round t as nonce.

**Range.** Decoding is exact iff |Σ_k w̃_k x_k| < 2^{b−1−f} per coordinate. A
client whose contribution exceeds 2^{b−1−f}/m (m participants of the round) in
any coordinate is *refused*: excluded and logged (status out-of-range), never
wrapped. The quantisation error of the decoded sum is at most W·2^{−f−1} per
coordinate (W ranks that hold clients) before the division by Σ w̃_k.

**Integer codes** (``compression.uplink: int8``): another stage may hand the
aggregator a :class:`~fedmpi.transforms.base.SumCode` whose per-client integer codes
need a narrower ring (b = 16 or 32, :attr:`SumCode.bits`). The masking above is the
same with that b: the keystream is read as b-bit words and the buffers travel as
uint16/uint32, summed with unsigned wrap-around; the code replaces the fixed point
(it keeps each client's contribution, agrees on its scale with one ``MAX``
``Allreduce`` before sealing, and decodes the centred sum).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
import torch

from fedmpi.errors import ConfigError
from fedmpi.transforms.base import SumCode, UpdateTransform
from fedmpi.transforms.ring import RingSum, ring_wire

if TYPE_CHECKING:
    from fedmpi.config.core import Config

RING_BITS = 48
#: the fewest accepted updates whose sum rank 0 may open: with fewer (exclusions) no rank
#: sends its masked sum and the round's update is withheld (docs/secure-aggregation.md)
MIN_ACCEPTED = 2
MOD = 1 << RING_BITS
_MASK = MOD - 1
KEY_WORDS = 4   # an X25519 public key: 32 bytes = 4 int64 words
#: the wire type of a ring 2^b: b = 48 in int64 (sums of up to 2^15 ranks cannot overflow),
#: the narrow rings of a :class:`SumCode` in unsigned words that wrap exactly modulo 2^b
WIRE: dict[int, np.dtype] = {RING_BITS: np.dtype(np.int64), 16: ring_wire(16), 32: ring_wire(32)}

__all__ = ["RING_BITS", "MOD", "KEY_WORDS", "WIRE", "SecureAggregator", "SecureAggregation", "encode",
           "decode", "limit"]


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import x25519
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError:
        raise ConfigError("config key 'privacy.secure_aggregation' needs the 'cryptography' "
                          "package: pip install -e '.[privacy]'") from None
    return hashes, x25519, Cipher, algorithms, modes, HKDF


def limit(scale_bits: int, participants: int) -> float:
    """The largest |contribution| per coordinate one of ``participants`` clients may send:
    2^{b−1−f} / m, so that the sum of m contributions decodes without wrapping."""
    return float(2 ** (RING_BITS - 1 - scale_bits)) / max(1, participants)


def encode(v: torch.Tensor, scale_bits: int) -> torch.Tensor:
    """round(v · 2^f) mod 2^b as int64 in [0, 2^b) (v float64, |v| within range)."""
    q = torch.round(v.to(torch.float64) * float(1 << scale_bits)).to(torch.int64)
    return torch.bitwise_and(q, _MASK)


def decode(e: torch.Tensor, scale_bits: int) -> torch.Tensor:
    """The centred value of a ring element (int64, any representative) ÷ 2^f, float64."""
    r = torch.bitwise_and(e, _MASK)
    r = torch.where(r >= MOD // 2, r - MOD, r)
    return r.to(torch.float64) / float(1 << scale_bits)


class SecureAggregator:
    """One rank's side of the protocol: its clients' key pairs, the pair secrets
    (derived on first use and kept for the run), masks and the fixed-point code.

    Args:
        hosted: the clients this rank trains.
        num_clients: K.
        scale_bits: f, fractional bits of the fixed-point code.
        code: integer codes that replace the fixed point (module docstring); their ring
            2^{code.bits} and its wire type (:data:`WIRE`) replace 2^48 in int64.
    """

    def __init__(self, hosted: Sequence[int], num_clients: int, scale_bits: int,
                 code: Optional[SumCode] = None) -> None:
        self.hashes, self.x25519, self.Cipher, self.algorithms, self.modes, self.HKDF = _crypto()
        self.hosted = list(hosted)
        self.K = num_clients
        self.scale_bits = scale_bits
        # a sum code's integers are summed as the unmasked int8 uplink sums them; the
        # masks are added to those ring elements
        self.ring = RingSum(code) if code is not None else None
        self.sums_exactly = code is not None
        self.bits = RING_BITS if code is None else int(code.bits)
        self.mod = 1 << self.bits
        self.ring_mask = self.mod - 1
        self.wire_dtype = WIRE[self.bits]
        self._private = {k: self.x25519.X25519PrivateKey.generate() for k in self.hosted}
        self._public: Optional[np.ndarray] = None     # [K, 32] uint8, every client's key
        self._pair: dict[tuple[int, int], bytes] = {}
        self._zeros = np.zeros(0, dtype=np.uint8)        # keystream scratch (_stream)
        self._scratch = np.zeros(0, dtype=np.uint8)
        self.range_limit = float("inf")
        self._float = torch.zeros(0, dtype=torch.float64)  # encode/decode scratch
        self.refused_because = "outside the secure-aggregation range (privacy.secagg.scale_bits)"
        self.min_accepted = MIN_ACCEPTED
        self.withheld_because = (f"withheld: fewer than {MIN_ACCEPTED} updates were accepted, "
                                 "and secure aggregation never opens one client's update")

    # ------------------------------------------------------------- codec
    def handshake(self) -> np.ndarray:
        """The key exchange's contribution: this rank's clients' public keys."""
        return self.public_words()

    def on_handshake(self, words: np.ndarray) -> None:
        self.set_public(words)

    def begin(self, participants: int) -> None:
        """A round with ``participants`` clients: each may contribute up to :func:`limit`
        (the fixed point; a :class:`SumCode` bounds its own codes)."""
        if self.ring is not None:
            self.ring.begin(participants)
            return
        self.range_limit = limit(self.scale_bits, participants)

    def accepts(self, x: torch.Tensor, weight: float) -> bool:
        """Whether ``weight·x`` decodes without wrapping (refused otherwise, never wrapped)."""
        if self.ring is not None:
            return self.ring.accepts(x, weight)
        return not x.numel() or float(x.abs().max()) * weight <= self.range_limit

    def take(self, client: int, parts: Sequence[tuple[torch.Tensor, float]]) -> bool:
        """A :class:`SumCode` keeps each accepted client's contribution (True); the fixed
        point is applied to the rank's float64 partial sum (False)."""
        return self.ring is not None and self.ring.take(client, parts)

    def agreement(self, size: int) -> Optional[np.ndarray]:
        """What this rank contributes to the ``MAX`` ``Allreduce`` before sealing (the
        code's per-block bound; None: nothing to agree on)."""
        return None if self.ring is None else self.ring.agreement(size)

    def on_agreement(self, agreed: np.ndarray) -> None:
        assert self.ring is not None
        self.ring.on_agreement(agreed)

    # ------------------------------------------------------------- keys
    def public_words(self) -> np.ndarray:
        """[K, 4] int64: this rank's clients' public keys, zero rows for the others
        (summed over ranks by one Allreduce, every row has exactly one owner)."""
        out = np.zeros((self.K, 32), dtype=np.uint8)
        for k, key in self._private.items():
            out[k] = np.frombuffer(key.public_key().public_bytes_raw(), dtype=np.uint8)
        return out.view(np.int64).copy()

    def set_public(self, words: np.ndarray) -> None:
        """Every client's public key, from the summed :meth:`public_words`."""
        self._public = np.ascontiguousarray(words, dtype=np.int64).view(np.uint8).reshape(self.K, 32)
        missing = [k for k in range(self.K) if not self._public[k].any()]
        if missing:
            raise RuntimeError(f"secure aggregation: no public key for clients {missing[:5]}")

    def _secret(self, k: int, j: int) -> bytes:
        pair = (min(k, j), max(k, j))
        if pair not in self._pair:
            assert self._public is not None, "set_public() first"
            peer = self.x25519.X25519PublicKey.from_public_bytes(bytes(self._public[j]))
            shared = self._private[k].exchange(peer)
            self._pair[pair] = self.HKDF(algorithm=self.hashes.SHA256(), length=32, salt=None,
                                         info=b"fedmpi secure aggregation %d %d" % pair
                                         ).derive(shared)
        return self._pair[pair]

    def _stream(self, key: bytes, t: int, size: int) -> np.ndarray:
        """PRG(s, t): ``size`` ring elements of the AES-256-CTR keystream (nonce = t): its
        little-endian 64-bit words mod 2^48, or its 16/32-bit words for a narrow ring.

        The keystream is the encryption of zeros, written with ``update_into`` into a
        scratch buffer kept between calls: no model-sized allocation per pair and round.
        The returned array is that scratch buffer, valid until the next call."""
        nbytes = self.wire_dtype.itemsize * size
        if self._zeros.size != nbytes:
            self._zeros = np.zeros(nbytes, dtype=np.uint8)
            self._scratch = np.empty(nbytes + 15, dtype=np.uint8)   # update_into: + block - 1
        nonce = int(t).to_bytes(8, "little") + bytes(8)
        enc = self.Cipher(self.algorithms.AES(key), self.modes.CTR(nonce)).encryptor()
        written = enc.update_into(self._zeros, self._scratch)
        assert written == nbytes and not enc.finalize()           # CTR: a stream cipher
        if self.bits != RING_BITS:
            return self._scratch[:nbytes].view(self.wire_dtype)
        raw = self._scratch[:nbytes].view(np.uint64)
        np.bitwise_and(raw, np.uint64(_MASK), out=raw)
        return raw.view(np.int64)

    def _add_mask(self, out: np.ndarray, k: int, t: int, peers: Sequence[int]) -> None:
        """``out ← out ± PRG(s_kj, t) (mod 2^b)`` in place for every j in ``peers``
        (+ for k < j, − for k > j; j = k is skipped). A narrow ring's unsigned words wrap
        modulo 2^b by themselves."""
        for j in peers:
            if j == k:
                continue
            s = self._stream(self._secret(k, int(j)), t, out.size)
            if k < j:
                out += s
            else:
                out -= s
            if self.bits == RING_BITS:
                np.bitwise_and(out, _MASK, out=out)

    def mask(self, k: int, t: int, accepted: Sequence[int], size: int) -> np.ndarray:
        """m_k of client ``k`` in round ``t`` among the ``accepted`` participants (ring
        elements in [0, 2^b), :attr:`wire_dtype`), every pair drawn;
        Σ_{k∈accepted} m_k ≡ 0 (mod 2^b)."""
        out = np.zeros(size, dtype=self.wire_dtype)
        self._add_mask(out, k, t, accepted)
        return out

    def seal(self, partial: torch.Tensor, t: int, mine: Sequence[int], accepted: Sequence[int],
             out: np.ndarray) -> None:
        """E_r = enc(S_r) + Σ_{k∈mine} m_k (mod 2^b) into the int64 send buffer ``out``;
        ``partial`` is the float64 S_r of this rank's accepted clients ``mine``.

        Only the pairs with j ∉ ``mine`` are drawn: the terms ±PRG(s_kj) and ±PRG(s_jk)
        of two clients on this rank cancel inside the sum, so E_r is the same ring element,
        bit for bit, and what this rank computes grows with the clients on *other* ranks
        (none at all when one rank hosts every accepted client, e.g. ``-n 1``).

        With a :class:`SumCode` the plain part is the sum of the codes of the clients it
        kept (:meth:`take`), modulo 2^b, and ``partial`` is not read."""
        own = {int(k) for k in mine}
        others = [int(j) for j in accepted if int(j) not in own]
        if self.ring is not None:
            self.ring.seal(partial, t, mine, accepted, out)
        else:
            v = partial.detach().cpu()
            q = self._float_scratch(v.numel())
            q.copy_(v).mul_(float(1 << self.scale_bits)).round_()     # = encode(), in place
            e = torch.from_numpy(out)
            e.copy_(q)                        # integral values: the conversion is exact
            e.bitwise_and_(_MASK)
        for k in own:
            self._add_mask(out, k, t, others)

    def open(self, total: np.ndarray, start: int = 0) -> torch.Tensor:
        """Σ_k w̃_k x_k (float64) from Σ_r E_r: :func:`decode`, computed in place in
        ``total`` (overwritten) and a float64 buffer kept between rounds (the returned
        tensor, valid until the next call). ``total`` holds the entries from ``start`` on
        (a :class:`SumCode` decodes the centred sum of its codes there)."""
        if self.ring is not None:
            return self.ring.open(total, start)
        r = torch.from_numpy(total)
        # the centred representative: ((r + 2^{b-1}) mod 2^b) − 2^{b-1}
        r.add_(MOD // 2).bitwise_and_(_MASK).sub_(MOD // 2)
        out = self._float_scratch(r.numel())
        out.copy_(r)
        return out.div_(float(1 << self.scale_bits))

    def _float_scratch(self, size: int) -> torch.Tensor:
        if self._float.numel() != size:
            self._float = torch.empty(size, dtype=torch.float64)
        return self._float


class SecureAggregation(UpdateTransform):
    """``privacy.secure_aggregation: true``: the uplink sums travel pairwise-masked
    (:class:`SecureAggregator` is the codec), and rank 0 holds only sums over the accepted
    clients (:attr:`sums_only`: every part that needs one client's statistics on rank 0 is
    refused, from its own declaration)."""

    name = "secure_aggregation"
    enable_key = "privacy.secure_aggregation"
    sums_only = True

    @classmethod
    def enabled(cls, cfg: Config) -> bool:
        return bool(cfg.privacy.secure_aggregation)

    @classmethod
    def check(cls, cfg: Config) -> None:
        """At least :data:`MIN_ACCEPTED` participants per round (one participant's sum is
        its update), and no exact reduction (it sends every update to rank 0 as a row)."""
        n = cfg.data.num_clients
        m = cfg.train.clients_per_round or n
        if m < MIN_ACCEPTED:
            key = "train.clients_per_round" if cfg.train.clients_per_round else "data.num_clients"
            raise ConfigError(f"config keys 'privacy.secure_aggregation' and {key!r}: secure "
                              f"aggregation needs at least {MIN_ACCEPTED} participants per round "
                              f"(got {m}): rank 0 would decode one client's update")
        if cfg.runtime.reduction == "exact":
            raise ConfigError("config keys 'privacy.secure_aggregation' and 'runtime.reduction': "
                              "the exact reduction sends every client's update to rank 0 as a row")

    def codec(self, hosted: Sequence[int], num_clients: int,
              code: Optional[SumCode] = None) -> SecureAggregator:
        return SecureAggregator(hosted, num_clients, int(self.cfg.privacy.secagg.scale_bits), code)
