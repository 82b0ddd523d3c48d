"""Training checkpoints with orbax-checkpoint: save every K steps without stalling the step, keep the last few,
resume exactly (same data order, same random state), onto any mesh, strategy or process count.

    spec = CheckpointSpec("ckpt/", every=5, resume=True)        # validated where it enters: no JAX needed
    ckpt = Checkpointer(spec, run_meta)                           # after JAX started (every process of a group)
    state, start = ckpt.restore(abstract_state)                   # resume: arrays placed as the abstract shardings say
    ckpt.maybe_save(step, state, losses)                          # after each step; asynchronous
    stats = ckpt.close()                                          # waits for the last save; CheckpointStats

What a checkpoint holds (one orbax step directory per saved step, `D/<step>/`):
- `state/`: every array of the training state (parameters, optimizer moments and count, fp8 scaling state, the step
  counter), saved by orbax's StandardCheckpointHandler as a flat dict keyed by leaf index; the leaf paths go in the
  metadata so a restore into a different structure is refused by name, not mis-assigned.
- `meta/` (JSON): the step; the data position (the next training batch index: batches are a pure function of
  (seed, step), workbench/data.py); the random state (the seed of the data stream and of the parameter init; the
  models draw no other randomness during training); what must match for an exact continuation (model config,
  precision, global batch, sequence length, microbatches, the learning-rate schedule's length); where it came from
  (strategy, mesh, processes) and the loss history up to the step.

Asynchronous: `CheckpointManager.save` returns once the arrays are copied off the devices; files are written by a
background thread while the next steps run (`save_blocking_s` measures the part the step waits for, and
`save_waiting_s` the share of it spent waiting for the previous save's write: saves closer together than one write
take queue behind each other). Atomic:
orbax writes `D/<step>.orbax-checkpoint-tmp-*` and renames it to `D/<step>` only once every process finished; a
save that dies leaves a tmp directory that is never read (and is removed when the next run starts) and the previous
step intact. Retention: the newest `keep` steps (CheckpointManagerOptions.max_to_keep).

Restore reshards: the target is the new run's abstract state (ShapeDtypeStructs carrying the new mesh's
shardings), so orbax reads for each device exactly its slice, whatever mesh, strategy or process count wrote it.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time

import numpy as np
from etils import epath

from workbench.errors import WorkbenchError
from workbench.measure.harness import timed

DEFAULT_KEEP = 3
# fields of the run that must be the same for a resumed run to continue the interrupted one exactly
MUST_MATCH = ("model", "precision", "batch_size", "seq_len", "microbatches", "seed", "schedule_steps")
# orbax's marks of a finished save: its metadata, and commit_success.txt (written last; on object stores, where
# there is no rename, it is the only mark)
STEP_MARKERS = ("_CHECKPOINT_METADATA", "commit_success.txt")


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    """Where and how often to checkpoint. Validated on construction (nothing is created or written here)."""

    directory: str
    every: int | None = None  # save after every `every` steps and after the last one; None: after the last only
    resume: bool = False
    keep: int = DEFAULT_KEEP
    asynchronous: bool = True

    def __post_init__(self):
        if self.every is not None and (int(self.every) != self.every or self.every < 1):
            raise WorkbenchError(f"--checkpoint-every must be a positive whole number of steps, got {self.every!r}")
        if int(self.keep) != self.keep or self.keep < 1:
            raise WorkbenchError(f"--keep-checkpoints must be >= 1, got {self.keep!r}")
        path = epath.Path(self.directory)
        if path.exists() and not path.is_dir():
            raise WorkbenchError(f"--checkpoint-dir {self.directory} is a file, not a directory; "
                                 "give a directory path")
        if self.resume:
            if not path.is_dir():
                raise WorkbenchError(f"--resume: no checkpoint directory {self.directory}; run once with "
                                     "--checkpoint-dir to create it, or drop --resume")
            if not complete_steps(path):
                found = ", ".join(sorted(p.name for p in path.iterdir())[:5]) or "nothing"
                raise WorkbenchError(f"--resume: {self.directory} holds no complete checkpoint (found {found}); "
                                     "point --checkpoint-dir at a directory a run saved into, or drop --resume")
        elif path.is_dir() and complete_steps(path):
            raise WorkbenchError(f"--checkpoint-dir {self.directory} already holds checkpoints (up to step "
                                 f"{max(complete_steps(path))}); pass --resume to continue from them, or choose an "
                                 "empty directory (nothing was written)")


def complete_steps(path) -> list[int]:
    """Steps of `path` whose orbax save finished (renamed from its tmp directory, its commit marks and both items
    present). Local paths and the object stores etils.epath reaches (gs://...)."""
    path = epath.Path(path)
    if not path.is_dir():
        return []
    out = []
    for p in path.iterdir():
        if p.is_dir() and p.name.isdigit() and all((p / m).exists() for m in STEP_MARKERS) \
                and (p / "meta").is_dir() and (p / "state").is_dir():
            out.append(int(p.name))
    return sorted(out)


@dataclasses.dataclass(frozen=True)
class CheckpointStats:
    """What checkpointing did and cost in one run (wall seconds measured with workbench.measure.harness.timed)."""

    directory: str
    every: int | None
    keep: int
    asynchronous: bool
    restored_step: int | None
    restore_s: float | None
    saved_steps: tuple[int, ...]
    save_blocking_s: tuple[float, ...]  # time each save held the training loop (all of it: the two parts below)
    save_waiting_s: tuple[float, ...]  # ... of which waiting for the previous save's background write to finish
    final_wait_s: float  # waiting at the end for the last background write
    kept_steps: tuple[int, ...]  # complete checkpoints on disk after the run (retention)
    # from the run's measured step times (step_overhead): the median timed step with a save and without one
    step_s_with_save: float | None = None
    step_s_without_save: float | None = None
    timed_saves: int = 0
    save_overhead_s: float | None = None

    def to_record(self) -> dict:
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        d["save_blocking_s_median"] = float(np.median(self.save_blocking_s)) if self.save_blocking_s else None
        d["save_waiting_s_median"] = float(np.median(self.save_waiting_s)) if self.save_waiting_s else None
        return d


def fault_point(kind: str, step: int, wait=None, until=None) -> None:
    """Test hook: SIGKILL this process when WORKBENCH_FAULT names this point ('after-step:12': once step 12's
    outputs `wait` are ready; 'in-step:13': while step 13 runs; 'in-save:10': while the save of step 10 is being
    written), optionally only on the process WORKBENCH_FAULT_PROCESS names. Nothing else reads the variable."""
    spec = os.environ.get("WORKBENCH_FAULT")
    if not spec:
        return
    want, _, at = spec.partition(":")
    if want != kind or not at.isdigit() or int(at) != step:
        return
    only = os.environ.get("WORKBENCH_FAULT_PROCESS")
    if only is not None:
        import jax

        if int(only) != jax.process_index():
            return
    if wait is not None:
        import jax

        jax.block_until_ready(wait)
    if until is not None:  # e.g. the save's tmp directory exists: the kill lands while it is being written
        deadline = time.monotonic() + 10.0
        while not until() and time.monotonic() < deadline:
            time.sleep(0.001)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _flat(tree) -> tuple[dict, list[str], object]:
    import jax

    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return ({f"{i:05d}": leaf for i, (_, leaf) in enumerate(leaves_with_paths)},
            [jax.tree_util.keystr(p) for p, _ in leaves_with_paths], treedef)


class Checkpointer:
    """An orbax CheckpointManager for one training run (see the module docstring). Every process of a group
    constructs one and calls the same methods at the same steps."""

    def __init__(self, spec: CheckpointSpec, run_meta: dict, total_steps: int):
        import orbax.checkpoint as ocp  # here, not at the top: ~1.5 s of imports that runs without checkpoints skip

        self.spec, self.run_meta, self.total_steps = spec, dict(run_meta), int(total_steps)
        options = ocp.CheckpointManagerOptions(max_to_keep=spec.keep, create=True, cleanup_tmp_directories=True,
                                               enable_async_checkpointing=spec.asynchronous)
        self.directory = spec.directory if "://" in spec.directory else os.path.abspath(spec.directory)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._ocp = ocp
        self.saved: list[int] = []
        self.blocking: list[float] = []
        self.waiting: list[float] = []
        self.restored_step: int | None = None
        self.restore_s: float | None = None
        self.history: list[float] = []  # losses of steps 1..restored_step, from the checkpoint

    # ----------------------------------------------------------------------------------------- restore
    def restore(self, abstract_state) -> tuple[object, int]:
        """(state placed with the abstract state's shardings, the step it was saved at) from the newest complete
        checkpoint. A checkpoint of another model, precision, batch or schedule, or one that cannot be read, is a
        WorkbenchError naming it (nothing on disk is changed)."""
        import jax

        steps = complete_steps(self.spec.directory)
        if not steps:
            raise WorkbenchError(f"--resume: {self.spec.directory} holds no complete checkpoint")
        step = steps[-1]
        where = os.path.join(self.spec.directory, str(step))
        ocp = self._ocp
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:
            raise WorkbenchError(f"checkpoint {where} is unreadable ({_first_line(e)}); delete that step directory "
                                 "to resume from the one before, or start without --resume") from None
        self._check_meta(meta, where)
        flat_abs, paths, treedef = _flat(abstract_state)
        if list(meta.get("leaf_paths", [])) != paths:
            raise WorkbenchError(f"checkpoint {where} holds a different state structure than this run builds "
                                 f"(first differing leaf: {_first_diff(meta.get('leaf_paths', []), paths)}); "
                                 "resume with the model and precision it was written with")
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in flat_abs.items()}
        try:
            got, self.restore_s = timed(lambda: self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))))
        except Exception as e:
            raise WorkbenchError(f"checkpoint {where} is unreadable ({_first_line(e)}); delete that step directory "
                                 "to resume from the one before, or start without --resume") from None
        flat = got["state"]
        state = jax.tree_util.tree_unflatten(treedef, [flat[k] for k in sorted(flat_abs)])
        self.restored_step = step
        self.history = [float(x) for x in meta.get("losses", [])][:step]
        return state, step

    def _check_meta(self, meta: dict, where: str) -> None:
        for key in MUST_MATCH:
            have, want = meta.get("run", {}).get(key), self.run_meta.get(key)
            if have != want:
                flag = {"schedule_steps": "--steps", "batch_size": "--batch", "seq_len": "--seq", "seed": "--seed",
                        "microbatches": "--microbatches", "precision": "--precision",
                        "model": "--preset/--set"}[key]
                shown = (lambda v: "another config" if key == "model" else v)
                raise WorkbenchError(f"checkpoint {where} was written with {key}={shown(have)}, this run has "
                                     f"{shown(want)}: an exact continuation needs the same {flag}")

    # ----------------------------------------------------------------------------------------- save
    def due(self, step: int) -> bool:
        """Save after step `step` (1-based count of steps done)?"""
        return step == self.total_steps or (self.spec.every is not None and step % self.spec.every == 0)

    def maybe_save(self, step: int, state, losses: list) -> bool:
        """Save `state` (after `step` steps) when due; `losses` are this run's losses so far (device scalars or
        floats; read here, once the step is done). Returns whether it saved."""
        if not self.due(step) or step in self.saved or step == self.restored_step:
            return False
        ocp = self._ocp
        flat, paths, _ = _flat(state)

        def save():
            meta = {"step": step, "data": {"next_batch": step, "stream": "numpy PCG64 seeded by [seed, batch index]"},
                    "rng": {"seed": self.run_meta.get("seed"), "init": "nnx.Rngs(seed)",
                            "note": "no other random state: the models draw nothing during training"},
                    "run": self.run_meta, "leaf_paths": paths,
                    "losses": self.history + [float(x) for x in losses]}
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat),
                                                            meta=ocp.args.JsonSave(meta)))

        _, waited = timed(self.manager.wait_until_finished)  # orbax would wait inside save(); timed apart here
        _, called = timed(save)
        self.saved.append(step)
        self.blocking.append(waited + called)
        self.waiting.append(waited)
        fault_point("in-save", step, until=lambda: any(n.startswith(f"{step}.") for n in os.listdir(self.directory)))
        return True

    def close(self) -> CheckpointStats:
        """Wait for the last background write, then report."""
        _, wait = timed(self.manager.wait_until_finished)
        self.manager.close()
        return CheckpointStats(self.spec.directory, self.spec.every, self.spec.keep, self.spec.asynchronous,
                               self.restored_step, self.restore_s, tuple(self.saved), tuple(self.blocking),
                               tuple(self.waiting), wait,
                               tuple(complete_steps(self.spec.directory)))


def step_overhead(times_s, timed_steps, saved_steps) -> dict:
    """Median step time of the timed steps that saved a checkpoint against those that did not (the save's cost
    to the loop), from one run's measured step times (`timed_steps[i]` is the 1-based step of `times_s[i]`)."""
    saved = set(saved_steps)
    with_save = [t for t, s in zip(times_s, timed_steps) if s in saved]
    without = [t for t, s in zip(times_s, timed_steps) if s not in saved]
    med = lambda xs: float(np.median(xs)) if xs else None
    a, b = med(with_save), med(without)
    return {"step_s_with_save": a, "step_s_without_save": b, "timed_saves": len(with_save),
            "save_overhead_s": (a - b) if (a is not None and b is not None) else None}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def _first_diff(a, b) -> str:
    for x, y in zip(a, b):
        if x != y:
            return f"{x} vs {y}"
    return f"{len(a)} leaves vs {len(b)}"
