"""The simulator and its exports (Chrome trace, Gantt chart)."""
from .simulator import Costs, SimResult, simulate

__all__ = ["Costs", "SimResult", "simulate"]
