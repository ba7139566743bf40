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
import logging
import queue
import threading
import weakref

log = logging.getLogger(__name__)


class DaemonPool:
    """`submit(fn, *args)` -> a concurrent.futures.Future, run by one of up to `workers` daemon
    threads, started as calls come (a cancelled future is skipped, never run). Once the pool is
    garbage, each idle thread ends (a None in the queue); a stuck one is abandoned.

    A call its caller gave up on while it ran (`abandon`: its time limit, or its trajectory
    cancelled) may never return: its thread is written off and another takes its place, so calls
    stuck for good do not use the pool up at once (a reviewer found a reward that hung once every
    few steps took a thread each time, until every reward of the run failed). At most `workers`
    threads are written off at a time, so the pool runs at most twice `workers` calls at once (a
    slow judge past its limit would otherwise get ever more calls); past that a stuck call keeps
    its thread, as before. Should a written-off call return after all, its thread ends."""

    def __init__(self, workers, name):
        self.workers, self.name = workers, name
        self.calls = queue.SimpleQueue()
        self.threads = []
        self.lock = threading.Lock()
        # futures given up on while running -> whether another thread took their thread's place
        self.abandoned = {}
        self.written_off = 0  # threads written off so far (replaced)
        self.started = 0  # threads started so far
        # the threads hold the queue, not the pool, so the pool can be collected
        weakref.finalize(
            self, lambda calls, n: [calls.put(None) for _ in range(n)], self.calls, workers
        )

    def submit(self, fn, *args, **kwargs):
        future = concurrent.futures.Future()
        self.calls.put((future, functools.partial(fn, *args, **kwargs)))
        with self.lock:  # one more thread while fewer than `workers` are not written off
            if len(self.threads) - self.replaced() < self.workers:
                self.start_thread()
        return future

    def abandon(self, future):
        """The caller gave up on `future`: queued, it never runs; running, its thread is written
        off (logged) and another started in its place, while fewer than `workers` are. Returns
        whether a thread was started (a thread came free, for calls waiting on one)."""
        if future.cancel():
            return False
        with self.lock:
            if future.done() or future in self.abandoned:
                return False
            replace = self.replaced() < self.workers
            self.abandoned[future] = replace
            if replace:
                self.written_off += 1
                self.start_thread()
        if replace:
            log.warning(
                "a %s call still runs past its time limit: its thread is written off (%d so far) "
                "and another takes its place",
                self.name,
                self.written_off,
            )
        else:
            log.warning(
                "a %s call still runs past its time limit, and %d calls written off still run: "
                "it keeps its thread (a function that never returns is a bug to fix)",
                self.name,
                self.workers,
            )
        return replace

    def replaced(self):
        """How many threads written off and replaced still run their calls (the lock held)."""
        return sum(self.abandoned.values())

    def was_replaced(self, future):
        """Whether `future`'s thread was written off and replaced (its thread ends with it)."""
        return self.abandoned.get(future, False)

    def start_thread(self):
        """One more worker thread (the lock held)."""
        self.started += 1
        thread = threading.Thread(
            target=work,
            args=(self.calls, self.lock, self.threads, self.abandoned),
            name=f"{self.name}_{self.started}",  # (not len(threads): ended ones leave the list)
            daemon=True,
        )
        thread.start()
        self.threads.append(thread)


def work(calls, lock, threads, abandoned):
    """A pool thread: run each queued call into its future, until a None (the pool is gone), or
    until a call its caller abandoned returns where another thread took this one's place."""
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
        with lock:
            if abandoned.pop(future, False):  # replaced: this thread is one too many
                threads.remove(threading.current_thread())
                return
