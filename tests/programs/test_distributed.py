"""Beyond one process: a 2-process run equals the 1-process run; checkpoints survive SIGKILL mid-save and
mid-run and resume to the uninterrupted losses, on another mesh, strategy or process count; a dead process stops
its group; bad checkpoint directories are one-line errors (exit 2) that change nothing; the results store survives
kills."""
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import jax
import pytest

from models.presets import get_config
from partitioning.mesh import make_mesh
from workbench.errors import WorkbenchError
from workbench.programs.checkpoint import CheckpointSpec, complete_steps
from workbench.programs.train import train_model
from workbench.results.store import Store
from workbench.testing import assert_close

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ("run", "--preset", "tiny", "--strategy", "fsdp", "--mesh", "data=8", "--devices", "8", "--seq", "32")
STEPS = 8


TAIL = 3000  # characters of a child's output shown when it fails


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def _process_logs(tmpdir: str) -> str:
    """The stderr of a group's other processes (`--processes N` keeps each in TMPDIR/workbench-p<i>-*.log; they
    outlive a launcher killed by the timeout, and are named in its message only when it could still write one)."""
    out = []
    for name in sorted(os.listdir(tmpdir)) if os.path.isdir(tmpdir) else ():
        if name.startswith("workbench-p") and name.endswith(".log"):
            with open(os.path.join(tmpdir, name), errors="replace") as f:
                out.append(f"--- {name} (last {TAIL} characters) ---\n{f.read()[-TAIL:]}")
    return "\n".join(out)


def _output(stdout, stderr, logs: str) -> str:
    parts = [(f"--- {name} (last {TAIL} characters) ---\n{_text(x)[-TAIL:]}") for name, x in
             (("stderr", stderr), ("stdout", stdout)) if _text(x).strip()]
    return "\n".join(parts + ([logs] if logs else [])) or "(no output)"


def wb(*args, env=None, timeout=300):
    """`python -m workbench ARGS`; a run past `timeout` fails the test with the last output of every process (the
    command's own stderr and stdout, and the other processes' logs of a `--processes N` group), not a bare timeout.
    The result's `.output` holds the same for assertion messages."""
    tmpdir = tempfile.mkdtemp(prefix="wb-test-")  # the group's process logs land here (TMPDIR), found on failure
    e = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=tmpdir, **(env or {}))
    try:
        r = subprocess.run([sys.executable, "-m", "workbench", *args], env=e, cwd=ROOT, capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired as x:
        out = _output(x.stdout, x.stderr, _process_logs(tmpdir))
        shutil.rmtree(tmpdir, ignore_errors=True)
        pytest.fail(f"`workbench {' '.join(args)}` ran past its {timeout} s timeout and was killed\n{out}",
                    pytrace=False)
    r.output = _output(r.stdout, r.stderr, _process_logs(tmpdir) if r.returncode else "")
    shutil.rmtree(tmpdir, ignore_errors=True)
    return r


def json_of(r):
    assert r.returncode == 0, r.output
    return json.loads(r.stdout)


def train(mesh_spec="data=8", strategy="fsdp", steps=STEPS, checkpoint=None, devices=None, overrides=None):
    mesh = make_mesh(mesh_spec, devices=devices)
    return train_model(get_config("tiny", overrides), strategy=strategy, mesh=mesh, steps=steps, seq_len=32, progress=False,
                       hardware=None, analytic=False, checkpoint=checkpoint).to_record()


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted one-process run: tiny, fsdp on data=8, STEPS steps."""
    return train()["losses"]


@pytest.fixture
def env(tmp_path):
    return {"WORKBENCH_RESULTS": str(tmp_path / "results")}


@pytest.mark.compile_heavy
def test_two_processes_equal_one_and_restore_on_one(tmp_path, env, reference):
    """2 processes x 4 devices = the 8-device mesh: the same losses; its checkpoint restores onto one process."""
    d = tmp_path / "ckpt"
    r = json_of(wb(*BASE, "--processes", "2", "--steps", str(STEPS), "--checkpoint-dir", str(d),
                   "--checkpoint-every", "4", "--json", env=env))
    assert r["processes"] == 2 and r["hosts"] == 1
    assert len(r["losses"]) == STEPS
    assert_close(r["losses"], reference, "float32")
    assert complete_steps(d) == [4, 8]
    rec = Store(os.path.join(env["WORKBENCH_RESULTS"], "records.jsonl")).records()
    assert len(rec) == 1 and rec[0]["spec"]["processes"] == 2  # process 0 records, the other stays quiet
    # multi-process -> one process: resume from step 4 in this process (8 devices, one process)
    shutil.rmtree(d / "8")
    again = train(checkpoint=CheckpointSpec(str(d), every=4, resume=True))
    assert again["first_step"] == 5 and again["resumed_from_step"] == 4
    assert_close(again["losses"], reference[4:], "float32")
    assert_close(again["loss_history"], reference, "float32")


@pytest.mark.compile_heavy
def test_kill_mid_save_and_mid_run_then_resume(tmp_path, env, reference):
    """SIGKILL while step 4's checkpoint is being written: step 2's stays usable. Resume on 2 processes, one of
    them SIGKILLed after step 5: the group stops at once. Resume on one process: ends with the uninterrupted
    losses."""
    d = str(tmp_path / "ckpt")
    args = (*BASE, "--steps", str(STEPS), "--checkpoint-dir", d, "--checkpoint-every", "2", "--json")
    r = wb(*args, env={**env, "WORKBENCH_FAULT": "in-save:4"})
    assert r.returncode == -signal.SIGKILL, r.output
    assert complete_steps(d) == [2]
    assert any(n.startswith("4.") for n in os.listdir(d)), os.listdir(d)  # the unfinished save of step 4

    r = wb(*args, "--resume", "--processes", "2",
           env={**env, "WORKBENCH_FAULT": "after-step:5", "WORKBENCH_FAULT_PROCESS": "1"})
    assert r.returncode != 0, r.output
    assert "process 1 of 2 was killed by SIGKILL" in r.stderr, r.output
    assert max(complete_steps(d)) >= 2 and all(s <= 5 for s in complete_steps(d))

    r = json_of(wb(*args, "--resume", env=env))
    first = r["first_step"]
    assert 3 <= first <= 6 and r["resumed_from_step"] == first - 1
    assert len(r["losses"]) == STEPS - first + 1
    assert_close(r["losses"], reference[first - 1:], "float32")
    assert_close(r["loss_history"], reference, "float32")
    assert r["checkpoint"]["kept_steps"][-1] == STEPS and len(r["checkpoint"]["kept_steps"]) <= 3


@pytest.mark.compile_heavy
def test_restore_onto_other_mesh_and_strategy(tmp_path):
    """An fsdp data=8 checkpoint continues as tp on model=8 and on one device with the same losses (tiny with 8
    heads, so that tp's heads split over 8 devices)."""
    heads = "n_heads=8"
    src = tmp_path / "fsdp"
    first = train(steps=STEPS, checkpoint=CheckpointSpec(str(src), every=4), overrides=heads)
    reference = first["losses"]
    assert first["checkpoint"]["saved_steps"] == [4, 8] and first["checkpoint"]["save_blocking_s_median"] > 0
    shutil.rmtree(src / "8")
    for name, mesh, strategy, devices in (("tp", "model=8", "tp", None), ("one", "data=1", "dp", jax.devices()[:1])):
        d = tmp_path / name
        shutil.copytree(src, d)
        r = train(mesh, strategy, checkpoint=CheckpointSpec(str(d), every=4, resume=True), devices=devices,
                  overrides=heads)
        assert r["first_step"] == 5 and r["mesh"] == dict(make_mesh(mesh, devices=devices).shape)
        assert r["checkpoint"]["restored_step"] == 4 and r["checkpoint"]["restore_s"] > 0
        assert_close(r["losses"], reference[4:], "float32")


def test_bad_checkpoint_dirs_exit_2_and_change_nothing(tmp_path, env):
    missing = tmp_path / "nope" / "x"
    r = wb(*BASE, "--steps", "2", "--checkpoint-dir", str(missing), "--resume", env=env)
    assert r.returncode == 2 and "no checkpoint directory" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not missing.exists() and not (tmp_path / "nope").exists()

    junk = tmp_path / "junk"
    (junk / "5").mkdir(parents=True)
    (junk / "5" / "state").write_text("not a checkpoint")
    (junk / "notes.txt").write_text("keep me")
    before = sorted((p.relative_to(junk).as_posix(), p.stat().st_mtime_ns) for p in junk.rglob("*"))
    r = wb(*BASE, "--steps", "2", "--checkpoint-dir", str(junk), "--resume", env=env)
    assert r.returncode == 2 and "no complete checkpoint" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert sorted((p.relative_to(junk).as_posix(), p.stat().st_mtime_ns) for p in junk.rglob("*")) == before
    assert not os.path.exists(os.path.join(env["WORKBENCH_RESULTS"], "records.jsonl"))

    r = wb(*BASE, "--steps", "2", "--checkpoint-every", "0", "--checkpoint-dir", str(junk), env=env)
    assert r.returncode == 2 and "--checkpoint-every" in r.stderr
    r = wb(*BASE, "--steps", "2", "--resume", env=env)
    assert r.returncode == 2 and "--checkpoint-dir" in r.stderr
    r = wb(*BASE, "--steps", "2", "--processes", "3", env=env)
    assert r.returncode == 2 and "does not split over 3 processes" in r.stderr


@pytest.mark.compile_heavy
def test_corrupt_or_foreign_checkpoint_is_refused(tmp_path):
    """A complete-looking step whose array files are damaged, or one of another model: WorkbenchError (exit 2),
    files untouched; an existing checkpoint directory without --resume is refused too."""
    d = tmp_path / "ckpt"
    train(steps=2, checkpoint=CheckpointSpec(str(d), every=2))
    with pytest.raises(WorkbenchError, match="already holds checkpoints"):
        CheckpointSpec(str(d), every=2)
    foreign = tmp_path / "foreign"
    shutil.copytree(d, foreign)
    with pytest.raises(WorkbenchError, match="schedule_steps=2"):
        train(steps=4, checkpoint=CheckpointSpec(str(foreign), every=2, resume=True))
    for p in (d / "2" / "state").rglob("*"):
        if p.is_file() and p.stat().st_size > 0 and "metadata" not in p.name:
            p.write_bytes(b"\0" * 7)
    before = sorted((p.as_posix(), p.stat().st_size) for p in d.rglob("*"))
    with pytest.raises(WorkbenchError, match="unreadable"):
        train(steps=2, checkpoint=CheckpointSpec(str(d), every=2, resume=True))
    assert sorted((p.as_posix(), p.stat().st_size) for p in d.rglob("*")) == before


def test_results_store_survives_sigkill(tmp_path):
    """A process SIGKILLed while appending records in a loop leaves a store that loads and takes appends."""
    path = tmp_path / "records.jsonl"
    code = textwrap.dedent(f"""
        from workbench.results.store import Store
        s = Store({str(path)!r})
        i = 0
        while True:
            s.append({{"kind": "k", "i": i, "pad": "x" * 50000}})
            i += 1
            if i == 20:
                print("ready", flush=True)
    """)
    err = tmp_path / "stderr.txt"
    with open(err, "w") as e:
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=e, text=True, cwd=ROOT)
    try:
        ready, _, _ = select.select([p.stdout], [], [], 120)  # the child's "ready", or fail with its last words
        line = p.stdout.readline() if ready else ""
        assert line.strip() == "ready", (f"no 'ready' from the appending child within 120 s (got {line!r}); its "
                                         f"stderr: {err.read_text(errors='replace')[-TAIL:]}")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    recs = Store(str(path)).records()
    assert len(recs) >= 20 and [r["i"] for r in recs] == list(range(len(recs)))
    Store(str(path)).append({"kind": "k", "i": -1})
    assert Store(str(path)).records()[-1]["i"] == -1
