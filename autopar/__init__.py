"""autopar: automatic intra-operator parallelism for stock JAX.

    >>> import autopar
    >>> step = autopar.parallelize(train_step, mesh=mesh, batch_argnums=(1,))
    >>> state, loss = step(state, batch)
    >>> print(autopar.dump(step.get_plan(state, batch)))
"""
from .api import ParallelizedFunction, parallelize
from .passes import plan
from .calibrate import Calibration, calibrate
from .checkpoint import all_steps, latest_step, restore_checkpoint, save_checkpoint
from .cluster import ClusterSpec, LogicalMesh
from .cost import CostModel
from .distributed import DistributedInfo, init_distributed, to_host
from .errors import (AutoparError, FallbackWarning, InfeasiblePlanError, InvalidArgumentError,
                     MicrobatchReductionWarning, PlanMismatchError, ProfileError,
                     UnsupportedError)
from .init import init_sharded
from .inspect import dump
from .grad import grad, value_and_grad
from .markers import mark_stage_boundary
from .measure import profile
from .options import (Annotations, AutoLayerOption, AutoStageOption, DataParallel, LayerReuse,
                      ManualLayerOption, ManualStageOption, MethodKind, PipeshardParallel,
                      Remat, Schedule, ShardParallel, SolverBackend, UniformStageOption, Zero2Parallel,
                      Zero3Parallel)
from .plan import ParallelPlan
from .profile import DeviceProfile
from .report import report

__all__ = [
    "parallelize", "plan", "dump", "mark_stage_boundary", "ParallelizedFunction", "ParallelPlan",
    "ShardParallel", "DataParallel", "LayerReuse", "Zero2Parallel", "Zero3Parallel", "MethodKind",
    "SolverBackend", "PipeshardParallel", "Schedule", "AutoLayerOption", "ManualLayerOption",
    "AutoStageOption", "UniformStageOption", "ManualStageOption", "grad", "value_and_grad",
    "ClusterSpec", "LogicalMesh", "CostModel", "profile", "DeviceProfile", "ProfileError",
    "calibrate", "Calibration", "init_distributed", "DistributedInfo", "to_host",
    "save_checkpoint", "restore_checkpoint", "latest_step", "all_steps", "init_sharded",
    "AutoparError", "InfeasiblePlanError", "InvalidArgumentError", "PlanMismatchError",
    "UnsupportedError", "FallbackWarning", "Annotations", "MicrobatchReductionWarning",
    "Remat",
    "report",
]
