"""Fault injection for tests/faults, in every Python process of a run the suite launches (test-only).

The suite puts this directory on PYTHONPATH and names the fault in $GROWMTP_FAULT; Ray's workers and vLLM's
engine processes inherit both. Without it, nothing is imported here. The faults are `helpers.faults`'.
"""

import os
import sys

if os.environ.get("GROWMTP_FAULT"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/
    from helpers import faults

    faults.install(os.environ["GROWMTP_FAULT"])
