"""A first stop signal to a run is one line on stderr at once (`stop requested (SIGTERM): stopping
after the current step; ...`), where the handler says it (one process, rank 0), before the step ends:
a user sees the signal arrived, and tests of signals wait for it instead of sleeping."""
from __future__ import annotations

import os
import random
import signal

import pytest

from flowrec.runtime.trainer import GracefulInterrupt

SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]


@pytest.mark.parametrize("sig", SIGNALS, ids=[s.name for s in SIGNALS])
def test_a_first_stop_signal_says_what_it_lets_finish(sig, capfd):
    # nothing showed that a signal had reached a run until its step (or checkpoint, or closing lines) ended
    finishing = random.choice(["the current step", "the run's last checkpoint", "the run's closing lines"])
    interrupt = GracefulInterrupt(say=True).stopping_after(finishing)
    with interrupt:
        os.kill(os.getpid(), sig)
        said = capfd.readouterr().err
        with pytest.raises(KeyboardInterrupt):  # a second one stops at once, with no second line
            os.kill(os.getpid(), sig)
    name = "Ctrl-C" if sig == signal.SIGINT else sig.name
    assert interrupt.requested
    assert said == f"stop requested ({name}): stopping after {finishing}; a second signal stops at once\n"
    assert capfd.readouterr().err == ""


def test_a_handler_that_does_not_say_stays_silent(capfd):
    # ranks other than 0 of a launch say nothing of their own: rank 0's line is the launch's
    sig = random.choice(SIGNALS)
    with GracefulInterrupt() as interrupt:
        os.kill(os.getpid(), sig)
    assert interrupt.requested and capfd.readouterr().err == ""
