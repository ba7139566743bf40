"""The small rank jobs of tests/test_distributed.py's launcher tests: each tests what
`parallel.launch` does with a rank that raises, is interrupted or gets a signal, and needs nothing
of the trainer. They live apart from dist_worker.py (which imports the whole trainer, ~2.4 s of CPU
in every process that imports it) because each spawned rank, and a test's own launcher process,
imports the module its job is defined in."""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import runtime.parallel as parallel  # noqa: E402


def fail_on_rank_1(out_dir):
    """Rank 1 raises while rank 0 waits for it in a collective: the job must end, not hang."""
    parallel.init()
    if parallel.rank() == 1:
        raise ValueError("rank 1 could not go on")
    parallel.barrier()
    parallel.close()


def interrupted(out_dir):
    """A Ctrl-C in a rank before its own handler is in (its imports, its config): Python's
    KeyboardInterrupt."""
    raise KeyboardInterrupt


def count_signals(out_dir):
    """A rank that records each SIGINT or SIGTERM it gets, for a launcher test: ready once its
    handlers are in, then, from the first signal, one second more to collect any repeat (as a
    StopSignal's rank finishes its step), and returns what came."""
    got = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: got.append(signal.Signals(signum).name))
    open(os.path.join(out_dir, f"ready_{os.environ['RANK']}"), "w").close()
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    return got
