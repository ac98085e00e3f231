"""autopar: automatic intra- and inter-operator parallelism for stock JAX.

    >>> import autopar
    >>> step = autopar.parallelize(train_step, mesh=mesh, batch_argnums=(1,))
    >>> state, loss = step(state, batch)
    >>> print(autopar.dump(step.get_plan(state, batch)))

The package is a stack of layers, each importing only the ones below it (checked by
`lint-imports`, pyproject.toml's [tool.importlinter]; tests/test_layers.py), bottom to top:

    core/      values only: errors, options and the enums a user passes, OpGraph, specs, the
               plan dataclasses and their JSON form (checked by plan_check), formatting of
               numbers, progress lines, the JAX compatibility shims
    frontend/  the user's world -> OpGraph and back: tracing, markers, value_and_grad, NNX,
               jit options, meshes, annotations metadata, loops, the graph interpreter
    cost/      the cluster, the cost model, HLO collectives, profiling, measuring, calibration
    intra_op/  sharding strategies and the ILP (Alpa section 4), the plan it builds
    inter_op/  layers, stages and submeshes (the DP, Alpa section 5), schedules, pipeshard and
               recomputation planning
    lowering/  a plan -> JAX programs with shardings (one mesh; pipeline stages)
    runtime/   the executor, microbatches, multi-host, checkpoints, sharded init
    verify/    a plan compiled and checked against what XLA compiled (memory)
    tools/     what a person looks at and keeps: dump, report, plan cache, runner-ups
    passes, api      the driver: `autopar.plan` and `autopar.parallelize`
    cli, cli_plan, models   the `autopar` command; reference Flax models (`autopar.models`)
"""
from autopar.api import ParallelizedFunction, parallelize
from autopar.core.enums import Annotations, Remat, Schedule, SolverBackend
from autopar.core.errors import (
                                 AutoparError,
                                 FallbackWarning,
                                 InfeasiblePlanError,
                                 InvalidArgumentError,
                                 MicrobatchReductionWarning,
                                 PlanMismatchError,
                                 ProfileError,
                                 UnsupportedError,
)
from autopar.core.options import (
                                 AutoLayerOption,
                                 AutoStageOption,
                                 DataParallel,
                                 LayerReuse,
                                 ManualLayerOption,
                                 ManualStageOption,
                                 MethodKind,
                                 PipeshardParallel,
                                 ShardParallel,
                                 UniformStageOption,
                                 Zero2Parallel,
                                 Zero3Parallel,
)
from autopar.core.plan import ParallelPlan
from autopar.cost.calibrate import Calibration, calibrate
from autopar.cost.cluster import ClusterSpec, LogicalMesh
from autopar.cost.measure import profile
from autopar.cost.model import CostModel
from autopar.cost.profiler import DeviceProfile
from autopar.frontend.grad import grad, value_and_grad
from autopar.frontend.markers import mark_stage_boundary
from autopar.passes import plan
from autopar.runtime.checkpoint import all_steps, latest_step, restore_checkpoint, save_checkpoint
from autopar.runtime.distributed import DistributedInfo, init_distributed, to_host
from autopar.runtime.init import init_sharded
from autopar.tools.dump import dump, summary
from autopar.tools.report import report

__all__ = [
    "parallelize", "plan", "dump", "summary", "mark_stage_boundary", "ParallelizedFunction",
    "ParallelPlan",
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
