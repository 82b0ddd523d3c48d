"""Beyond one process: a process group joined by `jax.distributed`, one global mesh over every process's devices.

JAX runs one controller process per host (a TPU pod slice: one per TPU VM; a GPU cluster: one per node or per GPU).
Every process runs the same program on the same global mesh; each owns (addresses) only its local devices, feeds
only their shard of the batch (workbench.programs.data.Batches.train_sharded) and XLA's collectives cross the processes
(on CPU through gloo over TCP, `jax_cpu_collectives_implementation='gloo'`).

Three ways into a group (the same `workbench run` command line on every process):
- `--processes N` (this host): `launch_local` starts N copies of the command, each told the coordinator
  (localhost, a free port), its id and the group size; process 0's output is the run's output, the others are
  quiet (their stderr is kept and shown when one fails). A process that dies makes the launcher stop the others
  at once (`FAIL_GRACE_S`) and say which one died and how.
- explicit `--coordinator HOST:PORT --num-processes N --process-id I`: one command per host, started by you.
- `--distributed`: what the cluster's environment says (jax.distributed.initialize's own auto-detection: Cloud TPU
  pod slices, SLURM, Open MPI, Kubernetes). Inside a SLURM step of several tasks (SLURM_NTASKS > 1) or an Open MPI
  job (OMPI_COMM_WORLD_SIZE > 1) that happens without the flag: such a run would otherwise be N unrelated runs.

`--devices` always counts the global mesh: simulated CPU devices are split evenly, each process owning
devices / N of them (fixed before JAX starts, workbench.hardware.devices.request_devices). On accelerators each process has
what its host has.

Failure: the coordinator waits `INIT_TIMEOUT_S` for every process to join, and the coordination service declares a
process dead after `HEARTBEAT_S` without a heartbeat, which ends the others (environment variables
WORKBENCH_INIT_TIMEOUT_S and WORKBENCH_HEARTBEAT_S override both; JAX's own defaults are 300 s and 100 s). A process
that fails with an error leaves at once, without jax.distributed's shutdown barrier (`_leave_at_once_on_error`): its
peers are then usually blocked in a collective that waits for it, so the barrier would hold it for JAX's
shutdown timeout (300 s) before aborting; leaving at once lets the launcher (or the heartbeat) stop the others.

The calibrated host: a simulated run's MFU ceiling is the host calibration (workbench.measure.calibrate, cached per
host). Where it is missing, it is measured once per host before the group forms (`calibrate_host_once`: one process
takes a lock in the cache directory and runs `workbench calibrate` in a fresh process, the others wait for it and
read the cached file), not by every process after training: a process other than 0 would measure a device it does
not own (jax.devices()[0] is process 0's), and every process of the host would measure while the others do.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib

from workbench.errors import WorkbenchError
from workbench.hardware.devices import request_devices, select_platform
from workbench.measure.calibrate import calibration_lock, cpu_features, fingerprint, load_or_calibrate

INIT_TIMEOUT_S = 120
HEARTBEAT_S = 20
FAIL_GRACE_S = 3.0
LAUNCHER_ENV = "WORKBENCH_LAUNCHER"  # set by launch_local in its children: the group's origin for the record


class GroupFailed(WorkbenchError):
    """A process of a local group failed; the others were stopped. Exits with that process's status."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """The processes a run spans (a single process is a group of one)."""

    processes: int
    process_id: int
    local_devices: int
    global_devices: int
    coordinator: str | None
    origin: str  # 'single' | 'local launcher' | 'explicit' | 'cluster:<how>' (auto-detected)

    @property
    def primary(self) -> bool:
        """Process 0 prints and records; the others stay quiet."""
        return self.process_id == 0

    def to_record(self) -> dict:
        return {"processes": self.processes, "process_id": self.process_id, "local_devices": self.local_devices,
                "global_devices": self.global_devices,
                "coordinator": self.coordinator, "origin": self.origin}


def free_port() -> int:
    """A TCP port nobody listens on now (the coordinator binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def cluster_env() -> str | None:
    """The multi-process job this process was started in, when its environment says so without asking anything
    (SLURM step of several tasks, Open MPI job of several ranks); None otherwise (Cloud TPU pod slices are found
    by jax.distributed.initialize itself, through `--distributed`)."""
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(v in os.environ for v in slurm) and _int_env("SLURM_NTASKS") > 1:
        return "slurm"
    if _int_env("OMPI_COMM_WORLD_SIZE") > 1 and "OMPI_MCA_orte_hnp_uri" in os.environ:
        return "ompi"
    return None


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name, "0"))
    except ValueError:
        return 0


def _env_processes() -> int | None:
    for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if _int_env(name) > 0:
            return _int_env(name)
    return None


def check_request(processes: int, devices: int | None, coordinator: str | None, num_processes: int | None,
                  process_id: int | None, distributed: bool) -> None:
    """One-line errors for a process-group request that cannot work (before anything starts)."""
    if processes < 1:
        raise WorkbenchError(f"--processes must be >= 1, got {processes}")
    explicit = [x is not None for x in (coordinator, num_processes, process_id)]
    if any(explicit) and not all(explicit):
        raise WorkbenchError("--coordinator, --num-processes and --process-id go together (all three, on every "
                             "process), or use --distributed to read them from the cluster's environment")
    if processes > 1 and (all(explicit) or distributed):
        raise WorkbenchError("--processes N starts N local processes itself; drop it when joining a group with "
                             "--coordinator/--num-processes/--process-id or --distributed")
    if all(explicit):
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise WorkbenchError(f"--process-id {process_id} must be in [0, --num-processes {num_processes})")
        if ":" not in coordinator:
            raise WorkbenchError(f"--coordinator {coordinator!r} must be HOST:PORT (process 0's host)")
    n = processes if processes > 1 else (num_processes or 1)
    if devices is not None and devices % n:
        raise WorkbenchError(f"--devices {devices} does not split over {n} processes; give a multiple of {n}")


# --------------------------------------------------------------------------------------------- the launcher
def _die_with_parent():  # in the child, before exec: SIGKILL when the launcher dies (Linux), so no orphans
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def _last_words(path: str, limit: int = 300) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return ""
    errs = [ln for ln in lines if ln.startswith("workbench: error:")]
    text = (errs or lines or [""])[-1]
    return text[-limit:]


def launch_local(child_args: list[str], processes: int, *, env: dict | None = None) -> tuple[int, str | None]:
    """Run `workbench <child_args>` as `processes` processes on this host joined into one group; returns the exit
    status to report (0 when all succeed, else the first failure's; 1 for a signal) and what to say about it (None
    when all succeeded, or when process 0 failed on its own and already said why on stderr).

    Process 0 inherits this process's stdout and stderr; the others' stdout is discarded and their stderr kept in
    a temporary file, shown (its last error line) when one of them fails. When any process fails, the others get
    FAIL_GRACE_S to end on their own, then SIGTERM, then SIGKILL: a group never hangs on a dead member.
    """
    port = free_port()
    base = dict(os.environ if env is None else env)
    base[LAUNCHER_ENV] = "local"
    procs, logs = [], []
    for i in range(processes):
        argv = [sys.executable, "-m", "workbench", *child_args, "--coordinator", f"localhost:{port}",
                "--num-processes", str(processes), "--process-id", str(i)]
        if i == 0:
            out, err, log = None, None, None
        else:
            log = tempfile.NamedTemporaryFile("w+", prefix=f"workbench-p{i}-", suffix=".log", delete=False)
            out, err = subprocess.DEVNULL, log
        logs.append(log.name if log else None)
        procs.append(subprocess.Popen(argv, stdout=out, stderr=err, env=base, preexec_fn=_die_with_parent))
        if log:
            log.close()
    failed: tuple[int, int] | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                return 0, None
            time.sleep(0.1)
        deadline = time.monotonic() + FAIL_GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in procs if p.poll() is None]
            for p in alive:
                p.send_signal(sig)
            t = time.monotonic()
            while time.monotonic() - t < 2.0 and any(p.poll() is None for p in alive):
                time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for path in logs:
            if path and failed is None:
                os.unlink(path)
    i, rc = failed
    for path in logs:
        if path and path != logs[i]:
            try:
                os.unlink(path)
            except OSError:
                pass
    if i == 0 and rc > 0:  # process 0 failed by itself (a bad input, a runtime error): its own line is on stderr
        return rc, None
    words = _last_words(logs[i]) if logs[i] else ""
    return (1 if rc < 0 else rc), (f"process {i} of {processes} {_describe_exit(rc)}; the other processes were "
                                   "stopped" + (f" (process {i}: {words})" if words else "")
                                   + (f"; its log: {logs[i]}" if logs[i] else ""))


# --------------------------------------------------------------------------------------------- joining a group
def _timeouts() -> tuple[int, int]:
    return (_int_env("WORKBENCH_INIT_TIMEOUT_S") or INIT_TIMEOUT_S, _int_env("WORKBENCH_HEARTBEAT_S") or HEARTBEAT_S)


def join(devices: int | None = None, *, coordinator: str | None = None, num_processes: int | None = None,
         process_id: int | None = None, distributed: bool = False, platform: str | None = "auto",
         host_ceiling: bool = True) -> ProcessGroup:
    """Join the process group (or stay a single process), fix the local device count, start JAX.

    Call before anything touches JAX devices. `devices` is the global simulated CPU device count (None: what the
    host has); each of N processes owns devices / N. host_ceiling: a group of several processes on simulated CPU
    devices makes sure the host calibration (its MFU ceiling) is cached before it forms (calibrate_host_once);
    False where the run does not price against the host (a catalogue chip's `--hardware`).
    """
    import jax

    origin = "single"
    if coordinator is not None:
        origin = "local launcher" if os.environ.get(LAUNCHER_ENV) == "local" else "explicit"
    elif distributed or cluster_env():
        origin = f"cluster:{cluster_env() or 'auto'}"
        num_processes = _env_processes()
    if origin == "single":
        n = request_devices(devices, platform)
        return ProcessGroup(1, 0, jax.local_device_count(), n, None, origin)

    chosen = select_platform(platform, simulated_devices=devices)
    per = None
    if devices is not None:
        if num_processes is None:
            raise WorkbenchError("--devices with --distributed needs the process count (SLURM_NTASKS or "
                                 "OMPI_COMM_WORLD_SIZE in the environment, or --num-processes with --coordinator)")
        if devices % num_processes:
            raise WorkbenchError(f"--devices {devices} does not split over {num_processes} processes")
        per = devices // num_processes
    simulated = jax.config.jax_platforms in (None, "", "cpu")
    if simulated:
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except Exception:  # a jax without the option: gloo is the only cross-process CPU path there
            pass
        if per is not None:
            jax.config.update("jax_num_cpu_devices", per)
    if chosen == "cpu" and host_ceiling:
        calibrate_host_once()  # before the group forms: no process of it waits in a collective meanwhile
    _native_stdout_to_stderr()
    init_s, beat_s = _timeouts()
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=init_s,
                                   heartbeat_timeout_seconds=beat_s)
    except Exception as e:  # a group that never formed: the reason in one line
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise WorkbenchError(f"could not join the process group at {coordinator or 'the cluster coordinator'} "
                             f"within {init_s} s ({msg}); start every process with the same --coordinator and "
                             "--num-processes, each with its own --process-id") from None
    _leave_at_once_on_error()
    if per is not None:
        request_devices(per)
    return ProcessGroup(jax.process_count(), jax.process_index(), jax.local_device_count(), jax.device_count(),
                        coordinator, origin)


def calibrate_host_once() -> None:
    """Make sure this host's calibration is cached, measuring it at most once however many processes of a group
    run here; call before jax.distributed.initialize (JAX's backends not started).

    Left to train_model, every process would find the cache missing after training and calibrate at once: each
    measuring while the others do, and every process but 0 measuring jax.devices()[0], a device of process 0 that
    it cannot address (its probes run nothing here: 'the host is too noisy to calibrate'). The process that then
    failed waited in jax.distributed's shutdown barrier while process 0 waited for it in the next collective, and
    the group stalled for JAX's 300 s shutdown timeout. Here one process takes an exclusive lock in the cache
    directory and runs `workbench calibrate` in a fresh process (this host's devices, nothing else running in it);
    the others block on the lock and then find the cached file. A failed calibration is a WorkbenchError (with the
    calibration's own reason) before this process joined: the launcher then stops the others at once."""
    def cached() -> bool:
        try:
            load_or_calibrate(run_if_missing=False)  # reads the cache; starts no JAX backend
            return True
        except (WorkbenchError, OSError, ValueError, KeyError):
            return False

    if cached():
        return
    # one lock per cached file, held while the calibration runs in its own process (which takes calibrate.lock)
    with calibration_lock(name=f"host-{fingerprint(cpu_features())}.lock"):
        if cached():  # another process of the group measured it while this one waited
            return
        print("workbench: this host has no calibration yet: measuring it once for the process group "
              "(`workbench calibrate`; the other processes wait for it)", file=sys.stderr, flush=True)
        p = subprocess.Popen([sys.executable, "-m", "workbench", "calibrate", "--platform", "cpu"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace")
        error = ""
        for line in p.stderr:  # its progress, shown as it comes (this process's stderr: process 0's or a log)
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.startswith("workbench: error:"):
                error = line[len("workbench: error:"):].strip()
        rc = p.wait()
    if rc != 0 or not cached():
        raise WorkbenchError(f"calibrating this host for the process group failed ({error or _describe_exit(rc)}); "
                             "run `workbench calibrate` once, then start the group again")


def _leave_at_once_on_error() -> None:
    """A process of a group that exits with an error (non-zero sys.exit, an uncaught exception) leaves without
    jax.distributed's shutdown barrier. Its peers are then usually blocked in a collective waiting for it and never
    reach that barrier, so the failed process would wait there JAX's whole shutdown timeout (300 s) and the group
    would stall that long before aborting. Leaving at once (os._exit with the same status, stdout and stderr
    flushed) lets the launcher see the failure and stop the others (FAIL_GRACE_S), or the coordination service miss
    the heartbeats (HEARTBEAT_S). A successful exit keeps the barrier: process 0 hosts the coordination service
    and must outlive the others. Registered after jax's own atexit clean-up, so it runs before it."""
    status: dict = {}
    real_exit, real_hook = sys.exit, sys.excepthook

    def exit_noting_status(code=0):
        status["code"] = code
        real_exit(code)

    def hook_noting_error(*exc_info):
        status["code"] = 1
        real_hook(*exc_info)

    def leave():
        code = status.get("code")
        if code is None or code == 0:
            return
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(code if isinstance(code, int) else 1)

    sys.exit, sys.excepthook = exit_noting_status, hook_noting_error
    atexit.register(leave)


def _native_stdout_to_stderr() -> None:
    """Gloo's C++ side prints connection notes ('[Gloo] Rank 0 is connected to 7 peer ranks') on file descriptor 1:
    point fd 1 at stderr and keep Python's sys.stdout on the original stdout, so a group's JSON stays clean."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = os.fdopen(saved, "w", buffering=1, encoding=getattr(sys.stdout, "encoding", None) or "utf-8")
    except (OSError, ValueError, AttributeError):
        pass


def count_hosts() -> int:
    """Distinct host names among the group's processes (a collective: every process calls it at the same point;
    workbench.programs.train.train_model does, for the record and the MFU ceiling)."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return 1
    from jax.experimental import multihost_utils

    mine = np.array([zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF], np.int32)
    return int(len(np.unique(np.asarray(multihost_utils.process_allgather(mine)))))
