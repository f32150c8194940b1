"""A lab command stopped with SIGTERM stops the servers it launched (``common.process.sigterm_unwinds``, as
``specprefill eval`` and ``specprefill bench`` run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

SCRIPT = """
import time
from common.process import sigterm_unwinds
from specprefill_lab.launch import launched_instant_backend
with sigterm_unwinds(), launched_instant_backend() as (_, server):
    print(server.pid, flush=True)
    time.sleep(120)
"""


def test_a_sigterm_stops_the_command_and_the_servers_it_launched():
    with subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True) as command:
        assert command.stdout is not None
        server = int(command.stdout.readline())
        command.send_signal(signal.SIGTERM)
        assert command.wait(timeout=60) == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):  # stopped and reaped by the command, not left running
        os.kill(server, 0)


def test_the_handler_before_is_back_after_the_block():
    from common.process import sigterm_unwinds

    before = signal.getsignal(signal.SIGTERM)
    with sigterm_unwinds():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
