"""A lab command stopped with SIGTERM stops the servers it launched (``specprefill_lab.launch.end_on_sigterm``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

SCRIPT = """
import time
from specprefill_lab.launch import end_on_sigterm, launched_instant_backend
end_on_sigterm()
with launched_instant_backend() as (_, server):
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
