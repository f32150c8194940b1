"""Dispatch: a plan taken to its replica and timed (``dispatcher``, its ``trace``), the backend's answer passed
back (``answer``), and what the answer teaches (``feedback``)."""
