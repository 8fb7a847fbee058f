"""One reader of DeepSpeed config files for every path (DeepSpeed's ``initialize``, the HF Trainer).

DeepSpeed reads its config as JSON or HJSON, or as base64-encoded JSON, and refuses a key given
twice (the second would silently win). Each path of ds_chimera reads the config before DeepSpeed
does (to find the ``"pipeline"`` section), so each reads it this one way: a config DeepSpeed would
refuse is never read differently here.
"""
from __future__ import annotations

import base64
import json
import os


def read_config(source) -> dict:
    """The config at ``source`` (a path, or base64-encoded JSON as DeepSpeed accepts it). Raises
    ValueError for a key given twice, the errors of JSON/HJSON parsing otherwise."""
    if os.path.exists(source):
        import hjson
        from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys
        with open(source) as fh:
            return hjson.load(fh, object_pairs_hook=dict_raise_error_on_duplicate_keys)
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys
    return json.loads(base64.urlsafe_b64decode(source).decode("utf-8"),
                      object_pairs_hook=dict_raise_error_on_duplicate_keys)
