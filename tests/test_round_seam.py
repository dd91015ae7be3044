"""The round as a seam (issue 45, item 1): the round loop over a round policy and an
exchange, and the narrow surface the rest of the code sees of it."""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import numpy as np
import pytest

from attribute_use import attributes_used
from conftest import ROOT, build_fed
from fedmpi.runtime.federation import PUBLIC, Federation
from fedmpi.runtime.policy import SynchronousRound

TINY = {"name": "seam", "seed": 3,
        "data": {"num_clients": 5, "partition": {"min_size": 20}},
        "train": {"rounds": 2, "clients_per_round": 3, "local_steps": 2, "batch_size": 16},
        "model": {"name": "mlp", "mlp": {"hidden": [8]}},
        "runtime": {"device": "cpu", "progress": False, "threads": 1}}


def _outside_files() -> list[Path]:
    loop = ROOT / "fedmpi" / "runtime" / "federation.py"
    return [p for d in ("fedmpi", "tests", "bench", "examples")
            for p in sorted((ROOT / d).rglob("*.py")) if p != loop]


# ------------------------------------------------------------------ the narrow surface
def test_code_outside_the_loop_uses_at_most_8_federation_attributes():
    """Issue 45: 44 distinct attributes of a Federation were used from fedmpi/ and tests/
    outside federation.py (46 with bench/ and examples/) at 3d45bc2; ≤ 8 wanted."""
    used = attributes_used(_outside_files())
    assert set(used) <= set(PUBLIC), {a: sorted(used[a]) for a in set(used) - set(PUBLIC)}
    assert len(used) <= 8


def test_the_federation_declares_its_surface_and_keeps_the_rest_private():
    """Every attribute a Federation defines (methods, properties, ``self.x = ...``) is in
    PUBLIC or starts with an underscore; PUBLIC names what exists."""
    tree = ast.parse((ROOT / "fedmpi/runtime/federation.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Federation")
    defined = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    defined |= {t.attr for n in ast.walk(cls) for t in
                (n.targets if isinstance(n, ast.Assign) else
                 [n.target] if isinstance(n, ast.AnnAssign) else [])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "self"}
    public = {a for a in defined if not a.startswith("_")}
    assert public == set(PUBLIC) and len(PUBLIC) <= 8


SAMPLE = '''
from fedmpi.runtime.federation import Federation

def make() -> Federation: ...
def rig() -> "ClientRig": ...
def pair() -> tuple[int, Federation]: ...

class Recording(Federation):
    def __init__(self):
        super().__init__()
        seen.append(self)
        self.mine = 1

def uses(fed: Federation, other):
    fed.alpha
    other.not_counted
    a = make()
    a.beta
    _, b = pair()
    b.gamma
    feds = {}
    feds["x"] = make()
    feds["x"].delta
    for f in [make()]:
        f.not_counted_either
    def inner():
        fed.epsilon
        fed = rig()
        fed.shadowed

def elsewhere():
    fed = rig()
    fed.theta0
    Federation.round
    Federation.__init__
    seen = []
    seen[0].zeta
'''


def test_the_attribute_count_finds_instances_by_annotation_factory_and_container(tmp_path):
    """The counter sees through annotations, factories (tuple results too), subclasses'
    ``self``, dict items and the class itself, and not through names bound otherwise."""
    path = tmp_path / "sample.py"
    path.write_text(textwrap.dedent(SAMPLE))
    used = attributes_used([path])
    assert set(used) == {"alpha", "beta", "gamma", "delta", "mine", "round"}


# ------------------------------------------------------------------ the round policy
def test_the_synchronous_policy_samples_m_of_k_and_closes_when_all_reported():
    pol = SynchronousRound(seed=7, num_clients=10, per_round=4)
    masks = [pol.participants(t) for t in range(20)]
    assert all(m.dtype == bool and m.sum() == 4 for m in masks)
    assert np.array_equal(pol.participants(3), SynchronousRound(7, 10, 4).participants(3))
    assert len({m.tobytes() for m in masks}) > 10                   # a draw per round
    rng = np.random.default_rng(np.random.SeedSequence([7, 0x5E1EC7, 3]))
    assert sorted(np.flatnonzero(masks[3])) == sorted(rng.choice(10, size=4, replace=False))
    mask = masks[0]
    reported = np.zeros(10, dtype=bool)
    for k in np.flatnonzero(mask):
        assert not pol.closes(reported, mask, 1e9)                    # no deadline
        reported[k] = True
    assert pol.closes(reported, mask, 0.0)
    assert pol.weight(0) == 1.0 and pol.weight(1) is None             # nothing is late


def test_the_methods_see_the_participants_of_the_round_policy():
    """The context's ``participants(t)`` (what FedGPS and the submodel methods plan with)
    and the round's mask both come from the policy: replacing it changes both."""
    fed = build_fed(TINY)
    chosen = {0: [0, 4], 1: [1, 2]}

    class Fixed(SynchronousRound):
        def participants(self, t: int) -> np.ndarray:
            mask = np.zeros(5, dtype=bool)
            mask[chosen[t]] = True
            return mask

    fed.policy = Fixed(3, 5, 3)
    assert np.flatnonzero(fed.built.ctx.participants(1)).tolist() == [1, 2]
    seen = []
    algo = fed.built.algo
    begin = algo.begin_round

    def spy(t, mask, *args):
        seen.append(np.flatnonzero(mask).tolist())
        return begin(t, mask, *args)
    algo.begin_round = spy
    fed.round(0)
    fed.round(1)
    assert seen == [[0, 4], [1, 2]]


# ------------------------------------------------------------------ the exchange
def test_a_round_makes_the_collective_sequence_of_calls(monkeypatch):
    """Moving the round into exchange verbs kept the messages: header Bcast, state Bcast,
    metadata Allreduce, statistics Reduce, in this order, one each (world size 1)."""
    from fedmpi.comm.world import Comm

    fed = build_fed(TINY)
    calls: list[str] = []
    for name in ("broadcast", "allreduce_sum", "reduce_sum", "gatherv_rows", "gather_fixed",
                 "allreduce_max"):
        orig = getattr(Comm, name)

        def spy(self, *args, _orig=orig, _name=name, **kwargs):
            calls.append(f"{_name}: {kwargs.get('what', '')}")
            return _orig(self, *args, **kwargs)
        monkeypatch.setattr(Comm, name, spy)
    fed.round(0)
    assert calls == ["broadcast: round 0 header Bcast", "broadcast: round 0 state Bcast",
                     "allreduce_sum: round 0 metadata Allreduce",
                     "reduce_sum: round 0 statistics Reduce"]


def test_the_federation_is_used_through_its_surface(tmp_path):
    """A stop releases the uplink but keeps θ; the checkpoint's view and the status agree."""
    fed = build_fed(TINY, **{"train.rounds": 1})
    before = fed.global_state.clone()
    assert fed.round(0) == 0
    assert not np.array_equal(before.numpy(), fed.global_state.numpy())
    theta = fed.global_state.clone()
    assert fed.round(1) == 1                                           # CMD_STOP
    assert np.array_equal(theta.numpy(), fed.global_state.numpy())
    assert fed.status.stop_reason is None and fed.status.failure is None
    assert fed.run_state().global_state.data_ptr() == fed.global_state.data_ptr()
    assert isinstance(fed, Federation)


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_exists(name):
    fed = build_fed(TINY)
    assert hasattr(fed, name)
