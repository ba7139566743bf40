"""Shared test fixtures (one real SGLang engine per session: starting one costs ~20-50 s on CPU),
background runs of the subprocesses whose tests only read their output, and the suite's time
against README's 8-minute target: printed with the engines started and the slowest tests, never a
failure (a correct change must not fail on a slow or busy machine)."""

import collections
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import runtime.checkpoint as checkpoint  # noqa: E402
import rollout  # noqa: E402
import runtime.model as model  # noqa: E402
from assemble import load_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The first 100 rows of GSM8K's train split (MIT, tests/data/GSM8K_LICENSE): shipped so the tests
# need no download.
GSM8K_TRAIN = os.path.join(REPO, "tests", "data", "gsm8k_train_100.jsonl")

# The session's scratch folder: the small Qwen and the background runs' folders, whose paths the
# tests name at import; removed when the session ends (pytest_unconfigure). A process of the suite
# that imports this module (a rank importing dist_worker) takes its parent's from the environment
# instead of making one of its own (before, every such import and every collection left a folder
# in /tmp: 700 of them on this machine).
SCRATCH_VARIABLE = "NANO_GRPO_TEST_SCRATCH"
MADE_SCRATCH = SCRATCH_VARIABLE not in os.environ
if MADE_SCRATCH:
    os.environ[SCRATCH_VARIABLE] = tempfile.mkdtemp(prefix="nano-grpo-tests-")
SCRATCH = os.environ[SCRATCH_VARIABLE]


def scratch(name):
    """The folder `name` in the session's scratch folder, made if new."""
    path = os.path.join(SCRATCH, name)
    os.makedirs(path, exist_ok=True)
    return path


def tiny_config(out_dir, *sets):
    """The CPU demo config, smaller and faster, writing under `out_dir`."""
    return load_config(
        "configs/tiny.yaml",
        [f"run.out={out_dir}", "rollout.prompts_per_step=8", "data.num_val_prompts=16", *sets],
    )


def train_on(run, samples, advantages, step=0):
    """update.update_policy on `samples` given their advantages as a tensor (the step writes them
    on the samples in advantages.compute), its metrics as this rank's plain numbers. `run`: a Run
    or an update.Trainer."""
    import update
    from metrics import local_values

    for sample, advantage in zip(samples, advantages.tolist()):
        sample.advantage = advantage
    trainer = getattr(run, "trainer", None) or run
    return local_values(update.update_policy(trainer, samples, step))


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    """A real SGLang engine serving the seeded tiny model; tests that change its weights restore
    them by syncing a fresh policy (train.setup does that when given this engine)."""
    os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path_factory.mktemp("engine")
    cfg = tiny_config(out)
    policy, tokenizer = model.build_policy(cfg, None)
    model_dir = checkpoint.export_for_engine(policy, tokenizer, str(out))
    engine = rollout.RolloutEngine(model_dir, cfg.rollout, dtype="float32", seed=0)
    yield engine
    engine.shutdown()


@pytest.fixture
def sent_seeds(engine, monkeypatch):
    """The sampling_seed of every request the shared engine receives from here on, in order."""
    sent = []
    request = engine.request

    async def recording(rid, input_ids, sampling):
        sent.append(sampling.get("sampling_seed"))
        return await request(rid, input_ids, sampling)

    monkeypatch.setattr(engine, "request", recording)
    return sent


@pytest.fixture
def policy(engine, tmp_path):
    """A fresh seeded tiny policy, pushed into the shared engine as version 0."""
    policy, _ = model.build_policy(tiny_config(tmp_path), None)
    engine.update_weights(policy.named_parameters(), version=0)
    return policy


# A small Qwen2.5-shaped model (tests/qwen_tiny.py: ~40 s, most of it supervised steps on the
# shipped GSM8K rows, so it stops at <|im_end|> and writes tool calls), built once per session by
# the background worker, first in its queue when a collected test needs it; the background runs that
# train it chain BUILD_QWEN (a no-op once built).
QWEN_TINY = os.path.join(SCRATCH, "qwen_tiny")  # made by its build
BUILD_QWEN = (
    f"(test -d {QWEN_TINY} || PYTHONPATH=. {sys.executable} tests/qwen_tiny.py {QWEN_TINY})"
)


@pytest.fixture(scope="session")
def qwen_tiny_dir(background_runs):
    """The small Qwen2.5-shaped model's folder, waited for."""
    background_runs.start("qwen_build", ["bash", "-c", BUILD_QWEN])
    background_runs.lines("qwen_build")
    return QWEN_TINY


# ---------------------------------------------------------------- background runs
class BackgroundRuns:
    """Commands whose tests only read their result (a benchmark's last line, a run's exit code
    and files), started when the suite is collected and run in worker threads ("lanes"), in
    order: each process (~30 s, most of it importing SGLang) uses a core that the in-process
    tests leave idle, instead of adding its time to the suite's. One lane while the in-process
    tests run (they use the other core); a second from the first time a test waits on a result
    (its core idles then) or the tests that only read results begin (`open_second_lane`). A test
    marks its command with `@pytest.mark.background(name, command)` and reads
    `background_runs.result(name)`: the CompletedProcess, waited for."""

    def __init__(self):
        self.runs = {}  # name -> Future of its CompletedProcess
        self.seconds = {}  # each finished run's wall time, for the summary
        self.queue = collections.deque()  # (name, command, timeout) not started yet, in order
        self.lock = threading.Lock()
        self.max_lanes = 1
        self.lanes = 0  # worker threads running
        self.running = {}  # name -> Popen of each command running
        self.stopped = False  # the session ended: nothing more starts

    def start(self, name, command, timeout=400):
        with self.lock:
            if name in self.runs:
                return
            self.runs[name] = concurrent.futures.Future()
            self.queue.append((name, command, timeout))
        self._spawn()

    def open_second_lane(self):
        self.max_lanes = 2
        self._spawn()

    def _spawn(self):
        with self.lock:
            while self.lanes < self.max_lanes and len(self.queue) > self.lanes:
                self.lanes += 1
                threading.Thread(target=self._lane, daemon=True).start()

    def _lane(self):
        """Run queued commands until none is left."""
        while True:
            with self.lock:
                if not self.queue:
                    self.lanes -= 1
                    return
                name, command, timeout = self.queue.popleft()
            future = self.runs[name]
            start = time.monotonic()
            try:
                with self.lock:
                    if self.stopped:
                        raise RuntimeError("the session ended before this run started")
                    process = self.running[name] = subprocess.Popen(
                        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                    )
                try:
                    out, err = process.communicate(timeout=timeout)
                except subprocess.TimeoutExpired:
                    kill_tree(process)
                    raise
                future.set_result(
                    subprocess.CompletedProcess(command, process.returncode, out, err)
                )
            except Exception as e:  # noqa: BLE001 - the reading test re-raises it
                future.set_exception(e)
            finally:
                self.running.pop(name, None)
                self.seconds[name] = time.monotonic() - start

    def stop(self):
        """Nothing queued starts any more, and what runs is killed with every process it started
        (a run cut short: -x, Ctrl-C), before the scratch folder goes."""
        with self.lock:
            self.stopped = True
            for name, _, _ in self.queue:
                self.runs[name].cancel()
            self.queue.clear()
            running = list(self.running.values())
        for process in running:
            kill_tree(process)

    def result(self, name):
        if not self.runs[name].done():
            # the caller's core idles while it waits: a second lane uses it
            self.open_second_lane()
        return self.runs[name].result()

    def lines(self, name):
        """The run's stdout lines, once it has exited 0 (else its stderr's end is the failure)."""
        done = self.result(name)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()


def kill_tree(process):
    """SIGKILL a command and every process under it (its engine's too, in any session), reaped."""
    try:
        tree = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for each in [process, *tree]:
        try:
            each.kill()
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
    process.wait()
    psutil.wait_procs(tree, timeout=10)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "background(name, command): run `command` in the background from collection on"
    )


def pytest_collection_modifyitems(session, config, items):
    """Start the background runs, in test order (none when only collecting), and move the tests
    that read them to the end: the in-process tests run meanwhile instead of waiting on the worker
    (both cores stay busy)."""
    reads = [item for item in items if any(item.iter_markers("background"))]
    items[:] = [item for item in items if item not in reads] + reads
    runs = config.stash[BACKGROUND] = BackgroundRuns()
    if config.option.collectonly:
        return
    if any("qwen_tiny_dir" in item.fixturenames for item in items):
        runs.start("qwen_build", ["bash", "-c", BUILD_QWEN])
    for item in reads:  # in test order
        for marker in item.iter_markers("background"):
            runs.start(*marker.args)


def pytest_runtest_setup(item):
    """The first test that reads a background run starts the tests that only read them (they run
    last): the in-process core is free from then on."""
    if any(item.iter_markers("background")):
        item.config.stash[BACKGROUND].open_second_lane()


@pytest.fixture(scope="session")
def background_runs(request):
    return request.config.stash[BACKGROUND]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------- the suite's time
SUITE_TARGET_S = 480  # README: the whole suite in 8 minutes on 2 cores, engine starts included


def pytest_sessionstart(session):
    """Counts the SGLang engines this process starts (each 30-90 s on 2 cores)."""
    session.config.stash[STARTED] = time.monotonic()
    session.config.stash[ENGINE_STARTS] = starts = [0]
    start_engine = rollout.RolloutEngine.__init__

    def counted(self, *args, **kwargs):
        starts[0] += 1
        start_engine(self, *args, **kwargs)

    rollout.RolloutEngine.__init__ = counted


def pytest_sessionfinish(session, exitstatus):
    """The wall time against the target, as a figure (the slowest tests: --durations)."""
    config = session.config
    elapsed = time.monotonic() - config.stash[STARTED]
    config.stash[BUDGET_LINE] = (
        f"suite time: {elapsed:.0f} s (target {SUITE_TARGET_S} s: "
        f"{'met' if elapsed <= SUITE_TARGET_S else 'not met'}), engines started in this process: "
        f"{config.stash[ENGINE_STARTS][0]}"
    )
    # a session with a failed test keeps the background runs' files for a look
    config.stash[KEEP_SCRATCH] = exitstatus == pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # the worker thread is often the critical path
    if BACKGROUND in config.stash and config.stash[BACKGROUND].seconds:
        runs = sorted(config.stash[BACKGROUND].seconds.items(), key=lambda item: -item[1])
        terminalreporter.write_line(
            "background runs: " + ", ".join(f"{name} {s:.0f} s" for name, s in runs)
        )
    if BUDGET_LINE in config.stash:
        terminalreporter.write_line(config.stash[BUDGET_LINE])
    if MADE_SCRATCH and config.stash.get(KEEP_SCRATCH, False):
        terminalreporter.write_line(f"the background runs' files, kept: {SCRATCH}")


def pytest_unconfigure(config):
    if BACKGROUND in config.stash:  # a run cut short (-x, Ctrl-C): nothing more runs
        config.stash[BACKGROUND].stop()
    if MADE_SCRATCH and not config.stash.get(KEEP_SCRATCH, False):
        shutil.rmtree(SCRATCH, ignore_errors=True)


STARTED = pytest.StashKey[float]()
ENGINE_STARTS = pytest.StashKey[list]()
BUDGET_LINE = pytest.StashKey[str]()
BACKGROUND = pytest.StashKey[BackgroundRuns]()
KEEP_SCRATCH = pytest.StashKey[bool]()
