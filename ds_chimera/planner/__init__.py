"""``"schedule": "auto"``: profile the user's model, then plan the fastest schedule that fits its memory.

- :mod:`.profile`: per-layer costs measured on the user's device and data; :mod:`.links` the
  point-to-point and all-reduce costs between its ranks;
- :mod:`.cuts`: layer cuts (balanced by measured time, or DeepSpeed's methods) and stage costs;
- :mod:`.memory`: bytes per rank by precision, ZeRO stage and the schedule's activation peak;
- :mod:`.search`: the search over schedules x options x cuts, priced by the simulator.
"""
from .profile import LayerCost, Links, Profile, profile_sequential
from .search import Budget, PlanResult, Setting, plan

__all__ = ["LayerCost", "Links", "Profile", "profile_sequential", "Budget", "PlanResult", "Setting", "plan"]
