"""Slow links (``hybridpar.train.links``), the parts that need no process group: a link's transfer is the least of
its sides' times exchange by exchange (a side that waited for a late peer is not the link's fault), its median over
the steps (a pause of the machine now and then is not a slow link), its factor against the other links of its kind
or, alone of its kind, against itself when first judged; and a link is named once, where it costs a step enough."""

from types import SimpleNamespace

import pytest

from hybridpar.train import links
from hybridpar.train.faults import Fault, SlowLink, Window, _parse
from hybridpar.train.links import GRADIENTS, HALO, Link, Links, _factor, _transfers

A, B = Link(HALO, (0, 1)), Link(HALO, (2, 3))
G = Link(GRADIENTS, (0, 1, 2, 3))


def step(times: dict, step_s: float = 1.0) -> dict:
    """One step of one rank: ``{link: [seconds of each exchange]}``, 100 bytes sent on each link."""
    return {"links": {link: (seconds, 100) for link, seconds in times.items()}, "step_s": step_s}


def test_the_transfer_is_the_least_side_exchange_by_exchange_and_its_median_over_steps():
    # rank 0 waits 5 s in exchange 0 for a late rank 1, rank 1 waits 5 s in exchange 1 for a late rank 0: the
    # transfer is 1 s each (the side that came last); step 3 is a pause of the machine that lengthened both sides
    steps = {0: [step({A: [6, 1]}), step({A: [6, 1]}), step({A: [9, 9]})],
             1: [step({A: [1, 6]}), step({A: [1, 6]}), step({A: [9, 9]})]}
    seconds, nbytes = _transfers([steps[0], steps[1]])
    assert seconds == {A: 2.0} and nbytes == {A: 200}  # both sides' bytes: the link carries both ways


def test_a_gradient_all_reduce_counts_its_bytes_once_and_its_least_rank():
    ranks = [[step({G: [0.3 + r, 0.2]})] for r in range(4)]
    seconds, nbytes = _transfers(ranks)
    assert seconds == {G: pytest.approx(0.5)} and nbytes == {G: 100}


def test_a_factor_is_against_the_other_links_of_its_kind_or_against_itself_first():
    seconds, nbytes = {A: 3.0, B: 1.0, G: 2.0}, {A: 100, B: 100, G: 50}
    first: dict = {}
    assert _factor(A, seconds, nbytes, first) == 3.0 and _factor(B, seconds, nbytes, first) == pytest.approx(1 / 3)
    assert _factor(G, seconds, nbytes, first) == 1.0 and first == {G: 2.0 / 50}
    assert _factor(G, {**seconds, G: 5.0}, nbytes, first) == 2.5


def test_a_slow_link_is_named_once_where_it_costs_enough_of_a_step(monkeypatch):
    """Judged over the last two windows; 3x and 0.3 s of a 1 s step in two judgements in a row: named (once); 3x of
    a few milliseconds: not."""
    monkeypatch.setattr(links.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(links.dist, "get_world_size", lambda: 4)
    per_rank = iter([])
    monkeypatch.setattr(links.dist, "all_gather_object", lambda out, mine: out.__setitem__(slice(None),
                                                                                           next(per_rank)))
    config = SimpleNamespace(train=SimpleNamespace(slow_window=1, slow_factor=1.5))
    for scale, named in ((0.1, [set(), {A}, set()]), (0.001, [set(), set(), set()])):
        window = [[step({A: [3 * scale]})], [step({A: [3 * scale]})], [step({B: [scale]})], [step({B: [scale]})]]
        per_rank = iter([window] * 4)
        timing = Links(config, None, [])
        assert timing.end(1) is None  # the first step is not timed
        assert timing.end(2) is None  # one window: nothing judged yet
        found = [timing.end(s) for s in (3, 4, 5)]
        assert [set(w.slow) for w in found] == named and all(w.factors[A] == pytest.approx(3.0) for w in found)


def test_the_link_fault_is_planned_by_the_environment_and_holds_from_its_step():
    assert _parse("link:1@3x4, link:2@1") == (Fault("link", 1, 3, 4), Fault("link", 2, 1))
    window = Window(3, None)
    held = SlowLink(window, 4)
    window.at(2)
    assert held.hold(1000) == 0.0
    window.at(3)
    assert held.hold(0) == pytest.approx(3 * 140e-6)
