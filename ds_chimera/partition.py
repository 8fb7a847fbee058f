"""DeepSpeed's layer cuts, the one implementation: the runtime cuts a PipelineModule with them and the
planner prices what a plain DeepSpeed run would cut (planner/cuts.py adds its own time-balanced cut)."""
from __future__ import annotations


def deepspeed_cut(method: str, weights: list, num_stages: int) -> list:
    """DeepSpeed's own cut, exactly as its engine makes it (the one place both the runtime and the planner
    call it): ``uniform`` the same number of layers per stage; ``parameters`` (or ``type:REGEX``, whose
    weights are 1 for a matching layer) balanced sums of ``weights``, one per layer."""
    from deepspeed.runtime import utils as ds_utils
    if method == "uniform":
        return [int(b) for b in ds_utils.partition_uniform(num_items=len(weights), num_parts=num_stages)]
    return [int(b) for b in ds_utils.partition_balanced(weights=weights, num_parts=num_stages)]
