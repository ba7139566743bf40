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

    A call its caller gave up on while it ran (`abandon`, at its time limit) may never return: its
    thread is written off and another takes its place, so calls stuck for good never use the pool
    up (a reviewer found a reward that hung once every few steps took a thread each time, until
    every reward of the run failed); should the call return after all, its thread ends."""

    def __init__(self, workers, name):
        self.workers, self.name = workers, name
        self.calls = queue.SimpleQueue()
        self.threads = []
        self.lock = threading.Lock()
        # futures given up on while running: their threads do not count among the workers
        self.abandoned = set()
        self.written_off = 0  # threads written off so far
        # the threads hold the queue, not the pool, so the pool can be collected
        weakref.finalize(
            self, lambda calls, n: [calls.put(None) for _ in range(n)], self.calls, workers
        )

    def submit(self, fn, *args, **kwargs):
        future = concurrent.futures.Future()
        self.calls.put((future, functools.partial(fn, *args, **kwargs)))
        with self.lock:  # one more thread while fewer than `workers` are not written off
            if len(self.threads) - len(self.abandoned) < self.workers:
                self.start_thread()
        return future

    def abandon(self, future):
        """The caller gave up on `future` (its time limit): queued, it never runs; running, its
        thread is written off (logged) and another started in its place."""
        if future.cancel():
            return
        with self.lock:
            if future.done() or future in self.abandoned:
                return
            self.abandoned.add(future)
            self.written_off += 1
            self.start_thread()
        log.warning(
            "a %s call still runs past its time limit: its thread is written off (%d so far) and "
            "another takes its place",
            self.name,
            self.written_off,
        )

    def start_thread(self):
        """One more worker thread (the lock held)."""
        thread = threading.Thread(
            target=work,
            args=(self.calls, self.lock, self.threads, self.abandoned),
            name=f"{self.name}_{len(self.threads)}",
            daemon=True,
        )
        thread.start()
        self.threads.append(thread)


def work(calls, lock, threads, abandoned):
    """A pool thread: run each queued call into its future, until a None (the pool is gone), or
    until a call its caller abandoned returns (another thread took this one's place)."""
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
            if future in abandoned:
                abandoned.discard(future)
                threads.remove(threading.current_thread())
                return
