"""The suite's two tiers: CI's (``make test``) and ``make test-full`` (``DS_CHIMERA_FULL=1``),
which adds the variants CI leaves out to stay within its 10-minute budget."""
import os

FULL = os.environ.get("DS_CHIMERA_FULL") == "1"
