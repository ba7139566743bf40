"""Worker threads for user code the rollout calls (plain reward functions, plain tools): a
thread pool whose threads never keep the process alive.

concurrent.futures.ThreadPoolExecutor joins its threads at interpreter exit
(concurrent/futures/thread.py, `_python_exit`), so one reward or tool that never returns (an
endless loop, a regex backtracking for hours, a socket with no timeout) kept the finished run,
or the one stopped by Ctrl-C after its checkpoint, from ever exiting. Its call was already given
up at its time limit; here the thread is a daemon, abandoned at exit. The futures are
concurrent.futures'. Python threads cannot be stopped, so no pool can do more.
"""

import concurrent.futures
import functools
import queue
import threading
import weakref


class DaemonPool:
    """`submit(fn, *args)` -> a concurrent.futures.Future, run by one of up to `workers` daemon
    threads, started as calls come (a cancelled future is skipped, never run). Once the pool is
    garbage, each idle thread ends (a None in the queue); a stuck one is abandoned."""

    def __init__(self, workers, name):
        self.workers, self.name = workers, name
        self.calls = queue.SimpleQueue()
        self.threads = []
        self.lock = threading.Lock()
        # the threads hold the queue, not the pool, so the pool can be collected
        weakref.finalize(
            self, lambda calls, n: [calls.put(None) for _ in range(n)], self.calls, workers
        )

    def submit(self, fn, *args, **kwargs):
        future = concurrent.futures.Future()
        self.calls.put((future, functools.partial(fn, *args, **kwargs)))
        with self.lock:  # one more thread while there are fewer than `workers`
            if len(self.threads) < self.workers:
                thread = threading.Thread(
                    target=work,
                    args=(self.calls,),
                    name=f"{self.name}_{len(self.threads)}",
                    daemon=True,
                )
                thread.start()
                self.threads.append(thread)
        return future


def work(calls):
    """A pool thread: run each queued call into its future, until a None (the pool is gone)."""
    while (item := calls.get()) is not None:
        future, call = item
        if not future.set_running_or_notify_cancel():  # cancelled while queued
            continue
        try:
            future.set_result(call())
        # whatever the user's code raises (SystemExit too) goes to whoever awaits it, as
        # ThreadPoolExecutor's workers do
        except BaseException as e:  # noqa: BLE001
            future.set_exception(e)
