"""One interface for fan-out work (sweep points, planner candidates, validation rows): a list of independent tasks,
each a picklable module-level function and its arguments, run on one of three back-ends, results yielded to the
caller as they finish:

    in-process   InProcessExecutor()        the tasks one after the other in this process (the default)
    local pool   PoolExecutor(n)            `--workers N`: N worker processes on this machine
    Ray cluster  RayExecutor("auto"|addr)   `--ray auto|ADDRESS`: one Ray task per point, num_cpus=1, memory requested
                                            from the task's estimate (`Task.memory_bytes`)

Workers only compute: a task returns its value to the parent, and the parent alone writes results (so a task that is
run twice — a retry after its worker died — is still written once by whoever keys the writes, see
Store.append_point). A task's exception comes back as a one-line error naming the worker (host:pid) it ran on; a
worker that dies (killed, out of memory) takes its task with it, and the task is run again on another worker up to
`retries` times before it is reported failed.

`make_executor(workers, ray)` turns the command-line options into a back-end and refuses bad ones with a one-line
WorkbenchError (exit 2): `--workers 0`, both options at once, Ray not installed, a Ray address that does not answer
(checked with a short TCP connect, so a wrong address never hangs the command).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from workbench.errors import WorkbenchError
from workbench.results.console import stderr_console

GiB = 2**30
CONNECT_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class Task:
    key: str                       # the caller's id for it (a sweep point's key)
    label: str                     # what the progress bar and errors call it
    fn: Callable[..., Any]         # a module-level function (pickled to the worker)
    args: tuple = ()
    memory_bytes: int | None = None  # what the task needs (Ray requests it; the others ignore it)
    fresh_process: bool = False    # Ray: a new worker process for it (max_calls=1), for work that sets up JAX


@dataclasses.dataclass(frozen=True)
class Result:
    task: Task
    ok: bool
    value: Any = None
    error: str | None = None       # one line
    worker: str = ""               # host:pid it ran on ("" when the worker died before saying)
    seconds: float | None = None
    attempts: int = 1


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return (msg if isinstance(e, WorkbenchError) else f"{type(e).__name__}: {msg}")[:300]


def call(fn: Callable, args: tuple) -> dict:
    """Run one task where it lands (any back-end's worker); never raises: the outcome, the worker and the time."""
    t0 = time.perf_counter()
    try:
        value, ok, err = fn(*args), True, None
    except Exception as e:  # noqa: BLE001 - one task's failure is reported, the others go on
        value, ok, err = None, False, one_line(e)
    return {"ok": ok, "value": value, "error": err, "worker": worker_id(), "seconds": time.perf_counter() - t0}


def _result(task: Task, out: dict, attempts: int) -> Result:
    return Result(task, out["ok"], out["value"], out["error"], out["worker"], out["seconds"], attempts)


class Executor:
    """Runs tasks; `run` yields each one's Result as it finishes (any order). `on_start(task)` is called as a task
    is handed to a worker, so `running` = started - finished."""

    name = "in-process"
    retries = 1

    def slots(self) -> int:
        return 1

    def describe(self) -> str:
        return self.name

    def run(self, tasks: Iterable[Task], on_start: Callable[[Task], None] | None = None) -> Iterator[Result]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class InProcessExecutor(Executor):
    """Today's behaviour: one task after the other, in this process."""

    def run(self, tasks, on_start=None):
        for t in tasks:
            if on_start:
                on_start(t)
            yield _result(t, call(t.fn, t.args), 1)


class PoolExecutor(Executor):
    """N worker processes on this machine (spawned, so a parent that imported JAX hands them nothing). A worker that
    dies breaks the pool: the pool is started again and the tasks it held are run again (up to `retries` times)."""

    name = "local pool"

    def __init__(self, workers: int, retries: int = 2):
        self.workers, self.retries = workers, retries
        self.pool: cf.ProcessPoolExecutor | None = None

    def slots(self) -> int:
        return self.workers

    def describe(self) -> str:
        return f"local pool of {self.workers} worker processes"

    def _pool(self) -> cf.ProcessPoolExecutor:
        if self.pool is None:
            import multiprocessing as mp

            self.pool = cf.ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"))
        return self.pool

    def run(self, tasks, on_start=None):
        queue = [(t, 1) for t in tasks]
        queue.reverse()
        live: dict[cf.Future, tuple[Task, int]] = {}
        while queue or live:
            broken = False
            while queue and len(live) < self.workers:
                t, n = queue.pop()
                try:
                    fut = self._pool().submit(call, t.fn, t.args)
                except cf.process.BrokenProcessPool:
                    # a worker died after its pool's last task ended: the task never started, so it is no try
                    queue.append((t, n))
                    broken = True
                    break
                live[fut] = (t, n)
                if on_start and n == 1:
                    on_start(t)
            if not broken:
                finished, _ = cf.wait(list(live), return_when=cf.FIRST_COMPLETED)
                broken = any(isinstance(f.exception(), cf.process.BrokenProcessPool) for f in finished)
            if broken:
                # a worker died, and the pool with it: every task it held ends; those that finished are kept, the
                # others run again on a new pool
                cf.wait(list(live))
                for fut, (t, n) in list(live.items()):
                    if not isinstance(fut.exception(), cf.process.BrokenProcessPool):
                        yield _result(t, fut.result(), n)
                    elif n <= self.retries:
                        queue.append((t, n + 1))
                    else:
                        yield Result(t, False, error="its worker process died (killed, or out of memory) on every "
                                     f"try ({n})", worker=socket.gethostname(), attempts=n)
                live.clear()
                self.pool.shutdown(wait=False, cancel_futures=True)
                self.pool = None
                continue
            for fut in finished:
                t, n = live.pop(fut)
                yield _result(t, fut.result(), n)

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


def _ray():
    try:
        import ray
    except ImportError:
        raise WorkbenchError("--ray needs Ray, which is not installed; install the extra: pip install -e '.[ray]'") \
            from None
    return ray


def _host_port(address: str) -> tuple[str, int]:
    rest = address.split("://", 1)[-1].rstrip("/")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise WorkbenchError(f"--ray {address!r} is not an address: give auto, HOST:PORT (the head's GCS, "
                             "e.g. 10.0.0.5:6379) or ray://HOST:10001")
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """A TCP connect to the Ray head, bounded by `timeout`: a wrong address is a one-line error, not a hang."""
    host, port = _host_port(address)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__).lower()
        raise WorkbenchError(f"no Ray cluster answers at {address} ({why}); start one with `ray start --head` and "
                             "pass its address (HOST:6379), or use --ray auto for one on this machine") from None


class RayExecutor(Executor):
    """Ray tasks, one per point: num_cpus=1, memory=Task.memory_bytes (so a node runs no more compiles than it has
    memory for), max_retries=`retries` (Ray reruns a task whose worker died). `address`: "auto" joins the cluster
    running on this machine ($RAY_ADDRESS, or one `ray start` started) and otherwise starts a local one for this
    command; HOST:PORT or ray://HOST:PORT joins that cluster. At most as many tasks are in flight as the cluster has
    CPUs, so `running` is what runs."""

    name = "ray"

    def __init__(self, address: str = "auto", retries: int = 1, num_cpus: int | None = None):
        ray = _ray()
        self.address, self.retries, self.started = address, retries, False
        if address != "auto":
            check_reachable(address)
        elif os.environ.get("RAY_ADDRESS"):
            check_reachable(os.environ["RAY_ADDRESS"])
        if not ray.is_initialized():
            kw: dict[str, Any] = {"address": None if address == "auto" else address, "include_dashboard": False,
                                  "log_to_driver": False, "logging_level": "ERROR", "configure_logging": True}
            if address == "auto" and num_cpus is not None:
                kw["num_cpus"] = num_cpus
            try:
                ray.init(**kw)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise WorkbenchError(f"cannot join the Ray cluster at {address}: {one_line(e)[:200]}; check the "
                                     "address (`ray status` on the head prints it)") from None
            self.started = True
        self.ray = ray
        self.remote = ray.remote(call)
        self.remote_fresh = ray.remote(max_calls=1)(call)

    def slots(self) -> int:
        return max(1, int(self.ray.cluster_resources().get("CPU", 1)))

    def describe(self) -> str:
        nodes = sum(1 for n in self.ray.nodes() if n.get("Alive"))
        return f"Ray cluster of {nodes} node(s), {self.slots()} CPUs"

    def run(self, tasks, on_start=None):
        ray = self.ray
        queue = list(tasks)
        queue.reverse()
        live: dict[Any, Task] = {}
        cap = self.slots()
        while queue or live:
            while queue and len(live) < cap:
                t = queue.pop()
                opts: dict[str, Any] = {"num_cpus": 1, "max_retries": self.retries, "name": t.label[:60]}
                if t.memory_bytes:
                    opts["memory"] = int(t.memory_bytes)
                fn = self.remote_fresh if t.fresh_process else self.remote
                live[fn.options(**opts).remote(t.fn, t.args)] = t
                if on_start:
                    on_start(t)
            ready, _ = ray.wait(list(live), num_returns=1)
            for ref in ready:
                t = live.pop(ref)
                try:
                    yield _result(t, ray.get(ref), 1)
                except Exception as e:  # noqa: BLE001 - the worker died on every try, or Ray refused the task
                    node = getattr(e, "ip", None) or getattr(getattr(e, "cause", None), "ip", None) or "ray"
                    yield Result(t, False, error=f"Ray: {one_line(e)[:250]}", worker=str(node),
                                 attempts=self.retries + 1)

    def close(self):
        if self.started:
            self.ray.shutdown()
            self.started = False


def check_options(workers: int | None = None, ray: str | None = None) -> None:
    """Refuse bad back-end options before any work (one-line WorkbenchError, exit 2): --workers below 1, both
    options, Ray not installed, a Ray address nothing answers at (a TCP connect of at most 5 s)."""
    if workers is not None and ray is not None:
        raise WorkbenchError("--workers and --ray are two back-ends: give one (--ray uses every CPU of the cluster)")
    if ray is not None:
        if not ray.strip():
            raise WorkbenchError("--ray needs auto or the cluster's address (HOST:6379)")
        _ray()
        if ray.strip() != "auto":
            check_reachable(ray.strip())
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise WorkbenchError(f"--workers must be a positive whole number (local worker processes), got {workers!r}")


def make_executor(workers: int | None = None, ray: str | None = None) -> Executor:
    """The back-end the options ask for (neither: in-process); bad options are a one-line WorkbenchError."""
    check_options(workers, ray)
    if ray is not None:
        return RayExecutor(ray.strip())
    if workers is not None and workers > 1:
        return PoolExecutor(workers)
    return InProcessExecutor()


# ---------------------------------------------------------------------------------------------------- progress


class FanOutProgress:
    """One progress bar on stderr over every worker: done/total, running, failed, ETA; a failed task's one-line
    error (and the worker it ran on) is printed above the bar as it comes in."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.enabled = total, desc, enabled
        self.running = self.done = self.failed = 0
        self.p = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


            self.p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                              TextColumn("running {task.fields[running]} · failed {task.fields[failed]}"),
                              TimeRemainingColumn(), console=stderr_console(), transient=True)
            self.p.__enter__()
            self.task = self.p.add_task(self.desc, total=self.total, running=0, failed=0)
        return self

    def _update(self, label: str | None = None):
        if self.p is not None:
            self.p.update(self.task, completed=self.done, running=self.running, failed=self.failed,
                          description=f"{self.desc}: {label[:40]}" if label else self.desc)

    def set_total(self, total: int):
        self.total = total
        if self.p is not None:
            self.p.update(self.task, total=total)

    def start(self, label: str):
        self.running += 1
        self._update(label)

    def finish(self, r: Result, name: str | None = None):
        self.running = max(0, self.running - 1)
        self.done += 1
        if not r.ok:
            self.failed += 1
            line = f"{name or r.task.label} failed on {r.worker or 'a worker that died'}: {r.error}"
            if self.p is not None and self.p.console.is_terminal:  # (callers list the failures again at the end)
                self.p.console.print(line, markup=False, highlight=False)
        self._update()

    def __exit__(self, *exc):
        if self.p is not None:
            self.p.__exit__(*exc)


def worker_rows(results: Iterable[Result]) -> list[dict]:
    """The summary table: per worker, the tasks it finished, how many failed, its busy seconds."""
    rows: dict[str, dict] = {}
    for r in results:
        w = rows.setdefault(r.worker or "(died)", {"worker": r.worker or "(died)", "tasks": 0, "failed": 0,
                                                   "busy s": 0.0})
        w["tasks"] += 1
        w["failed"] += 0 if r.ok else 1
        w["busy s"] += r.seconds or 0.0
    return sorted(rows.values(), key=lambda w: w["worker"])
