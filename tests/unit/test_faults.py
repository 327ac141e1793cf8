"""Faults on purpose (``HYBRIDPAR_FAULTS``): the forms an entry takes and the errors of those it cannot, a slow or
link fault's window (from its step or its signal, for its seconds), and the faults that wait for a signal: the rank
that receives it meets the fault, in every attempt."""

import os
import signal

import pytest
import torch
from torch import nn

from hybridpar.errors import ConfigError
from hybridpar.train import faults
from hybridpar.train.faults import Fault, Window, _parse


def test_entries_take_a_step_a_factor_a_duration_or_a_signal():
    assert _parse("kill:3@5, slow:1@5x3for60 link:0@2for9,stall@usr1,slow@usr2x3for60") == (
        Fault("kill", 3, 5), Fault("slow", 1, 5, 3, 60), Fault("link", 0, 2, 2, 9), Fault("stall", None, None,
                                                                                           signal="usr1"),
        Fault("slow", None, None, 3, 60, "usr2"))


@pytest.mark.parametrize("entry", ["kill@usr1", "nan@usr2", "kill:1@2for5", "stall:1@2x3", "slow:1@2x1",
                                   "slow@usr3", "slow:1@2for0", "slow:1", "stall:*@3"])
def test_an_entry_of_no_form_is_refused_naming_it_and_the_forms(entry):
    with pytest.raises(ConfigError) as err:
        _parse(entry)
    assert f"HYBRIDPAR_FAULTS: {entry!r} is not KIND:RANK@STEP" in str(err.value) and "KIND@usr1" in str(err.value)


def test_a_window_opens_at_its_step_or_its_signal_and_closes_after_its_seconds(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(faults.time, "monotonic", lambda: now[0])
    window = Window(3, 60)
    window.at(2)
    assert not window.active
    window.at(3)
    now[0] += 59.9
    window.at(4)
    assert window.active  # opened once, at step 3: later steps do not move it
    now[0] += 0.2
    assert not window.active
    waiting = Window(None, 10)
    waiting.at(1000)
    assert not waiting.active  # only its signal opens it
    waiting.start()
    assert waiting.active
    now[0] += 10
    assert not waiting.active
    waiting.start()  # again, at each signal
    assert waiting.active
    assert Window(1, None).active is False and (lambda w: (w.at(1), w.active)[1])(Window(1, None))


class _Model:
    def __init__(self):
        self.layer = nn.Linear(4, 4)

    def computing_modules(self):
        return [self.layer]


@pytest.fixture
def usr_signals():
    saved = {number: signal.getsignal(number) for number in faults.SIGNALS.values()}
    yield
    for number, handler in saved.items():
        signal.signal(number, handler)
    faults._stall.clear()


def test_a_signal_slows_the_rank_that_receives_it_for_its_seconds(monkeypatch, usr_signals):
    monkeypatch.setenv(faults.ENV, "slow@usr2x3for60")
    model = _Model()
    busy = []
    monkeypatch.setattr(faults, "_busy", busy.append)
    armed = faults.arm(model, [])
    armed.at(1)
    model.layer(torch.ones(2, 4))
    assert busy == []  # armed, not yet slowed
    os.kill(os.getpid(), signal.SIGUSR2)
    armed.at(2)
    model.layer(torch.ones(2, 4)).sum().backward()
    assert len(busy) == 2 and busy[1] == pytest.approx(2 * busy[0])  # the forward's extra time, its backward's twice


def test_a_signal_stalls_the_rank_that_receives_it_in_its_next_step(monkeypatch, usr_signals):
    monkeypatch.setenv(faults.ENV, "stall@usr1")
    assert faults.arm(_Model(), []) is None  # nothing acts over time: a stall is one event
    loss = torch.tensor(1.0)
    assert faults.after_backward(1, loss) is loss
    os.kill(os.getpid(), signal.SIGUSR1)
    monkeypatch.setattr(faults.time, "sleep", lambda _: (_ for _ in ()).throw(TimeoutError("stalled")))
    with pytest.raises(TimeoutError, match="stalled"):
        faults.after_backward(2, loss)
