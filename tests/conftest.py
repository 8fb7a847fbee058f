import os
import sys

import pytest

# Two pytest workers share two cores with the 4-rank jobs they start: torch's intra-op threads in
# a worker would only oversubscribe them. A test that needs several threads sets them itself
# (test_ops_cpp's thread-count check).
os.environ.setdefault("OMP_NUM_THREADS", "1")


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# pytest-xdist (--dist loadfile) hands files to its workers in collection order: the longest go first,
# so the suite does not end with one worker running a long file alone while the other core idles.
LONGEST_FIRST = ["test_runtime_deepspeed_api.py", "test_megatron.py", "test_runtime_deepspeed.py", "test_hf_trainer.py", "test_ops_interpreter.py",
                 "test_wavelet.py", "test_user_scripts.py", "test_chaos.py", "test_gpt_pipe.py", "test_launcher.py",
                 "test_ops.py"]


def pytest_collection_modifyitems(session, config, items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))    # stable: the rest keep their order


@pytest.fixture(scope="module")
def rank_results(request, tmp_path_factory):
    """Every rank's results of the test module's ``SCENARIOS``, one launch per module (tests/deepspeed_runs.py)."""
    from deepspeed_runs import run_family
    return run_family(tmp_path_factory.mktemp("dist"), request.module.SCENARIOS)


@pytest.fixture(scope="module")
def results(rank_results):
    return rank_results[0]
