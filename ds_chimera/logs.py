"""The ``ds_chimera`` logger: rank-prefixed, quiet by default.

Every module logs to ``logging.getLogger("ds_chimera")``. Unless the application has
configured that logger itself, the first use attaches one handler to stderr whose lines
read ``[ds_chimera rank R] ...``. The level comes from ``DS_CHIMERA_LOG_LEVEL`` (a logging
level name); by default global rank 0 reports INFO (the schedule it runs, progress every
``steps_per_print`` steps) and every other rank only warnings and errors.
"""
from __future__ import annotations

import logging
import os
import sys

NAME = "ds_chimera"
ENV_LEVEL = "DS_CHIMERA_LOG_LEVEL"


def global_rank() -> int:
    """This process's global rank: torch.distributed's once initialised, else the launcher's."""
    # not imported here: the simulator and the CLI run without torch (its import costs seconds),
    # and a process group exists only where torch.distributed was imported already
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = global_rank()
        return True


def get_logger() -> logging.Logger:
    """The package logger, with its rank-prefixed handler attached once."""
    logger = logging.getLogger(NAME)
    if not getattr(logger, "_ds_chimera_configured", False):
        logger._ds_chimera_configured = True
        if not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.addFilter(_RankFilter())
            handler.setFormatter(logging.Formatter("[ds_chimera rank %(rank)s] %(message)s"))
            logger.addHandler(handler)
            logger.propagate = False
        level = os.environ.get(ENV_LEVEL)
        if level:
            logger.setLevel(level.upper())
        elif logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO if global_rank() == 0 else logging.WARNING)
    return logger
