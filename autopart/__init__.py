"""autopart: plan and run data-, tensor- and pipeline-parallel PyTorch from an unmodified model."""

from autopart.advise import advise, advise_serving
from autopart.api import evaluate, parallelize, parse_bytes, plan
from autopart.calibrate import calibrate, load_calibration
from autopart.cost import Cluster, preset
from autopart.extend import register_op
from autopart.placement import Partial, Replicate, Shard
from autopart.plan import Plan
from autopart.planner import NoPlanFits, PlanInputError
from autopart.regions import register_token_local
from autopart.runtime.mesh import Mesh, mesh

__all__ = ["Cluster", "Mesh", "NoPlanFits", "Partial", "Plan", "PlanInputError", "Replicate", "Shard", "advise",
           "advise_serving", "calibrate", "evaluate", "load_calibration", "mesh", "parallelize", "parse_bytes", "plan",
           "preset", "register_op", "register_token_local"]
__version__ = "0.1.0"
