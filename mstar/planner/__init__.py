"""SLO-aware placement planning (``mstar plan``, in progress): the workload a deployment must serve
(``workload``) and the objectives it must meet (``slo``)."""

from mstar.planner.slo import SLO, Objective, SLOError, parse_slo
from mstar.planner.workload import Workload, WorkloadError, load_workload, parse_workload

__all__ = ["SLO", "Objective", "SLOError", "Workload", "WorkloadError", "load_workload", "parse_slo", "parse_workload"]
