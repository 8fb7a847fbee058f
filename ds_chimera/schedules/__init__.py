"""Pipeline schedules as data: a placement plus one ordered list of compute actions per rank."""
from .actions import (BACKWARD, FORWARD, INPUT_GRAD, STEP, WEIGHT_GRAD, Action, CommBatch, GradSync,
                      Message, OptimizerStep)
from .base import Schedule
from .lowering import Program, lower
from .placement import Chunk, Placement
from .registry import ENTRY_POINT_GROUP, available, build, get, register

__all__ = ["Action", "BACKWARD", "Chunk", "CommBatch", "ENTRY_POINT_GROUP", "FORWARD", "GradSync",
           "INPUT_GRAD", "Message", "OptimizerStep", "Placement", "Program", "STEP", "Schedule",
           "WEIGHT_GRAD", "available", "build", "get", "lower", "register"]
