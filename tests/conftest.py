import os
import sys

# Two pytest workers share two cores with the 4-rank jobs they start: torch's intra-op threads in
# a worker would only oversubscribe them. A test that needs several threads sets them itself
# (test_ops_cpp's thread-count check).
os.environ.setdefault("OMP_NUM_THREADS", "1")


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
