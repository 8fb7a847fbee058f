"""Pipeline schedules as data: a placement plus one ordered list of compute actions per rank."""
from .actions import (BACKWARD, FORWARD, INPUT_GRAD, STAGE_STEP, WEIGHT_GRAD, Action, Comm, SyncStart,
                      Message, Step)
from .base import Schedule
from .lowering import Program, lower
from .placement import Chunk, Placement
from .registry import ENTRY_POINT_GROUP, available, build, get, register

__all__ = ["Action", "BACKWARD", "Chunk", "Comm", "ENTRY_POINT_GROUP", "FORWARD", "SyncStart",
           "INPUT_GRAD", "Message", "Step", "Placement", "Program", "STAGE_STEP", "Schedule",
           "WEIGHT_GRAD", "available", "build", "get", "lower", "register"]
