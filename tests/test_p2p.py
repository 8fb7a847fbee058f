"""The pipeline's point-to-point transport (ds_chimera.runtime.p2p.P2P) on two gloo ranks.

It posts on the process group's own send/recv with each peer's group rank looked up once, so these
check what that must keep: messages land by tag in the right buffers on the default group and on a
subgroup whose ranks differ from the global ones, a static edge sends its header once and its later
receives are posted ahead of need (their buffers counted until taken), dynamic shapes send a header
each time, and a changed shape on a static edge is an error that names the edge and the fix.
"""
import json

from netutil import run_ranks

SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist
from ds_chimera.runtime.p2p import P2P
from ds_chimera.schedules.actions import Message

dist.init_process_group("gloo")
me = dist.get_rank()
sub = dist.new_group([1, 0])                # a group of its own: its ranks are looked up, not assumed
out = {}

def transport(dynamic, group):
    # pipeline rank p is global rank 1 - p: the lookup from pipeline rank to group rank is exercised
    return P2P(lambda p: 1 - p, "cpu", 2, 30.0, dynamic_shapes=dynamic, default_group=group)

for name, dynamic, group in (("static-world", False, None), ("static-sub", False, sub), ("dynamic", True, None)):
    p2p, pipe_rank = transport(dynamic, group), 1 - me
    got, held = [], []
    for mb in range(3):
        msg = Message("act", 0, 1, mb)
        rows = 2 + mb if dynamic else 2
        if pipe_rank == 0:
            p2p.send(msg, 1, (torch.full((rows, 3), float(mb)), torch.arange(4) + mb))
        else:
            if mb > 0:
                p2p.prepost(Message("act", 0, 1, mb), 0, "test")
            held.append(p2p.preposted_bytes)
            x, ids = p2p.recv(msg, 0, "test")
            got.append([x.shape[0], x.sum().item(), ids.tolist(), x.requires_grad])
    p2p.flush()
    out[name] = {"got": got, "early": p2p.early_receives, "held": held + [p2p.preposted_bytes]}

p2p = transport(False, None)
try:
    for mb, rows in ((0, 2), (1, 5)):
        if me == 1:
            p2p.send(Message("act", 0, 1, mb), 1, torch.zeros(rows, 3))
        elif mb == 0:
            p2p.recv(Message("act", 0, 1, mb), 0, "test")
    out["changed"] = "no error"
except RuntimeError as exc:
    out["changed"] = str(exc)
p2p.flush()
dist.barrier()
with open(sys.argv[1] + f".{me}", "w") as fh:
    json.dump(out, fh)
dist.destroy_process_group()
"""


def test_messages_land_in_order_with_headers_once_and_shape_changes_refused(tmp_path):
    script = tmp_path / "p2p.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    results, _ = run_ranks([str(script), str(out)], 2, {"OMP_NUM_THREADS": "1", "DS_CHIMERA_FAULT_MONITOR": "0"},
                           timeout_s=120)
    for rank, (code, _, err) in enumerate(results):
        assert code == 0, (rank, err[-3000:])
    receiver = json.loads((tmp_path / "out.0").read_text())     # global rank 0 is pipeline rank 1
    for name in ("static-world", "static-sub"):
        assert receiver[name]["got"] == [[2, 0.0, [0, 1, 2, 3], False], [2, 6.0, [1, 2, 3, 4], False],
                                         [2, 12.0, [2, 3, 4, 5], False]], name
        assert receiver[name]["early"] == 2, name          # the header came with the first message only
        assert receiver[name]["held"] == [0, 2 * 3 * 4 + 4 * 8, 56, 0], name    # a posted receive's buffers
    assert receiver["dynamic"]["got"] == [[2, 0.0, [0, 1, 2, 3], False], [3, 9.0, [1, 2, 3, 4], False],
                                          [4, 24.0, [2, 3, 4, 5], False]]
    assert receiver["dynamic"]["early"] == 0                # every message carries its header
    assert receiver["dynamic"]["held"] == [0, 0, 0, 0]
    sender = json.loads((tmp_path / "out.1").read_text())
    assert "pipeline tensor shapes changed on act 0->1" in sender["changed"], sender["changed"]
    assert "[2, 3]" in sender["changed"] and "[5, 3]" in sender["changed"]
    assert "dynamic_shape=True" in sender["changed"]
