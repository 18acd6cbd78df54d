"""The analysis stages: the registry (lmcal.stages.registry), their settings (lmcal.stages.configs), one module per
stage named after it (compute(target, settings) -> Result, over the maths of the lmcal.core module of the same name),
the figures, the tables and the W&B run.

A stage kept outside the package registers itself through this public path:

    from lmcal.stages import Result, Stage, register
"""

from lmcal.errors import LmcalError
from lmcal.stages.configs import store_schemas
from lmcal.stages.registry import STAGES, load_plugins, register, run_stage, run_stages
from lmcal.stages.stage import Result, Stage, publish, target
from lmcal.utils.boundary import fail_at_import

__all__ = ["STAGES", "Result", "Stage", "publish", "register", "run_stage", "run_stages", "target"]

store_schemas()  # analysis.<stage>'s schema, before any entry point composes its config

try:
    load_plugins()  # after the names above exist: a plugin imports them from here
except LmcalError as e:
    fail_at_import(e)  # python -m lmcal.<name>: one paragraph, exit 2 (this runs before its boundary starts)
    raise
