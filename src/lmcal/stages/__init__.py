"""The analysis stages: the registry (lmcal.stages.registry), one module per stage named after it (its files, tables
and figures, over the maths of the lmcal.core module of the same name), the figures, the tables and the W&B run.

A stage kept outside the package registers itself through this public path:

    from lmcal.stages import Stage, register
"""

from lmcal.errors import LmcalError
from lmcal.stages.registry import STAGES, load_plugins, register, run_stages
from lmcal.stages.stage import Stage
from lmcal.utils.boundary import fail_at_import

__all__ = ["STAGES", "Stage", "register", "run_stages"]

try:
    load_plugins()  # after the names above exist: a plugin imports them from here
except LmcalError as e:
    fail_at_import(e)  # python -m lmcal.<name>: one paragraph, exit 2 (this runs before its boundary starts)
    raise
