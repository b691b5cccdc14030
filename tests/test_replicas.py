"""Replicas under torchrun: the wait while the main replica prepares a run alone outlasts the
collectives' own timeout."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

REPLICA = """
import os, time
from datetime import timedelta
from dualend.train.parallel import Replicas

# the collectives' timeout well above two processes' start-up skew (it bounds their rendezvous too)
replicas = Replicas("cpu", timeout=timedelta(seconds=6), main_prepares_timeout=timedelta(seconds=60))
if replicas.main:
    time.sleep(10)  # preparing alone, longer than the collectives' timeout
replicas.wait_for_main()
print(f"replica {replicas.rank}: waited for the main replica", flush=True)
if replicas.main:
    time.sleep(10)
try:
    replicas.total(1.0)
    print(f"replica {replicas.rank}: the all-reduce waited too", flush=True)
except RuntimeError:
    print(f"replica {replicas.rank}: the all-reduce timed out", flush=True)
os._exit(0)  # see Replicas.exit_together: gloo's teardown after a failed collective may abort
"""


def test_the_other_replicas_wait_for_the_main_one_beyond_the_collectives_timeout(tmp_path):
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "replica 1: waited for the main replica" in done.stdout, done.stdout + done.stderr
    # the same wait on the collectives' own timeout fails: the wait above needed its own
    assert "replica 1: the all-reduce timed out" in done.stdout, done.stdout + done.stderr
