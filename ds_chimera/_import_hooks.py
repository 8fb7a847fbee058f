"""Run a callback right after a module is imported, without importing it ourselves.

Importing DeepSpeed or Megatron costs seconds, and the CLI and simulator must stay light,
so the integrations patch those packages the moment a user's script imports them.
"""
from __future__ import annotations

import importlib.util
import sys


class AfterImport:
    """A meta-path finder that runs ``callback(module)`` once ``name`` has been executed."""

    def __init__(self, name: str, callback):
        self.name, self.callback = name, callback
        self._searching = False

    def find_spec(self, name, path=None, target=None):
        if name != self.name or self._searching:
            return None
        self._searching = True            # find the real spec without finding ourselves again
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._searching = False
        if spec is None or spec.loader is None:
            return spec
        hook, exec_module = self, spec.loader.exec_module

        def exec_and_call(module):
            exec_module(module)
            if hook in sys.meta_path:    # stay installed until the module has really been imported
                sys.meta_path.remove(hook)
            hook.callback(module)

        spec.loader.exec_module = exec_and_call
        return spec


def call_after_import(name: str, callback) -> None:
    """``callback(module)`` now if ``name`` is imported, else right after its import."""
    if name in sys.modules:
        callback(sys.modules[name])
    elif not any(isinstance(f, AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(name, callback))
