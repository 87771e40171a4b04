"""Settings for every test run under this repository (each package's tests,
integration_tests/), read before anything imports torch.

OpenMP threads that sleep when idle (``OMP_WAIT_POLICY=PASSIVE``) in the
pytest processes too, not only in the ranks that zerostack.testing.spawn
starts (see its [Note: OpenMP threads that sleep]): torch's spinning threads
in one pytest worker take the cores that the other worker and its ranks
need. On a loaded 2-core machine the low-precision training test of
packages/testing/tests/test_tolerance.py took 18.5-21.5 s spinning and
4.7-5.0 s with PASSIVE. libgomp reads the variable when torch loads it, so
it is set here, where pytest-xdist's workers inherit it; a value set by the
caller wins.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
