"""`cadence plan`: predict wall time, TPSPD, busy fractions and staleness of every pipeline mode
for a cluster and a workload, by discrete-event simulation of the pipeline's own rules, and
recommend the split of devices between inference and training.

costs.py (throughput model and formulas) <- sim.py (the simulation) <- planner.py (modes x
splits) <- report.py (table, PNG, JSON); calibrate.py measures this machine with the real engine
and learner. Nothing here runs in a training process.
"""

from cadence.plan.costs import DeviceSpec, ModelShape, Profile, Throughput, from_hardware
from cadence.plan.lengths import ResponseLengths, load_empirical
from cadence.plan.planner import ClusterPlan, PlanResult, plan
from cadence.plan.sim import Shape, SimResult, Workload, simulate
from cadence.plan.spec import PlanSpec, load_spec

__all__ = [
    "ClusterPlan",
    "DeviceSpec",
    "ModelShape",
    "PlanResult",
    "PlanSpec",
    "Profile",
    "ResponseLengths",
    "Shape",
    "SimResult",
    "Throughput",
    "Workload",
    "from_hardware",
    "load_empirical",
    "load_spec",
    "plan",
    "simulate",
]
