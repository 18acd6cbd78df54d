"""The claims generated from the numbers live in lmcal.reporting.claims; `lmcal.pipeline.claims`, the name earlier
versions and users' scripts import, is that same module (an alias, not a copy)."""

import sys

from lmcal.reporting import claims

sys.modules[__name__] = claims
