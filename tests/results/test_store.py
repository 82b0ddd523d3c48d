"""The results store (append-only JSON Lines, provenance, torn writes) and its figures."""
import json
import os

import jax
import pytest

from workbench.errors import WorkbenchError
from workbench.results.store import Store, make_record


def test_store_roundtrip_and_dataframe(tmp_path):
    st = Store(str(tmp_path))
    r = st.append(make_record("t", {"op": "x"}, extra={"v": float("nan")}, seed=3))
    st.append(make_record("u", {"op": "y"}))
    assert [x["id"] for x in st.records()][0] == r["id"]
    assert r["extra"]["v"] is None and r["provenance"]["seed"] == 3 and r["provenance"]["jax"] == jax.__version__
    df = st.load()
    assert len(df) == 2 and "spec.op" in df.columns
    assert len(st.records("u")) == 1


def test_corrupt_and_incomplete_files(tmp_path, capsys):
    """A torn last line (a writer killed mid-append) is skipped by readers and set aside, byte for byte, by the next
    append; a damaged line before the end is a one-line error naming it."""
    st = Store(str(tmp_path))
    st.append(make_record("t", {}))
    before = open(st.path).read()
    with open(st.path, "a") as f:
        f.write('{"half": ')  # a torn write
    assert len(st.records()) == 1  # readers skip the torn tail
    st.append(make_record("t", {}))
    assert "incomplete record" in capsys.readouterr().err
    torn = list(tmp_path.glob("records.jsonl.torn-*"))
    assert len(torn) == 1 and torn[0].read_text() == '{"half": ', "nothing lost: the torn bytes are kept aside"
    assert open(st.path).read().startswith(before) and len(st.records()) == 2
    with open(st.path) as f:
        lines = f.readlines()
    with open(st.path, "w") as f:
        f.writelines([lines[0], '{"broken"\n', lines[1]])
    with pytest.raises(WorkbenchError, match=r"records.jsonl:2"):
        st.records()
    assert json.loads(before)["kind"] == "t"
    os.remove(st.path)
    assert st.records() == []


def test_mfu_chart_writes_a_png(tmp_path):
    from workbench.results.figures import mfu_chart

    rows = [{"devices": d, "strategy": "dp", "mesh": f"data={d}", "batch": 8, "mfu": m,
             "mfu_bound": b,
             "kernel_profile": {"kernel_ms": 10.0, "classes": {"matmul": {"ms": 7.0}, "collective": {"ms": 3.0}}}}
            for d, m, b in ((1, 0.5, 0.85), (8, 0.4, None))]
    path = mfu_chart(rows, str(tmp_path / "mfu.png"), targets={1: 0.8, 8: 0.65})
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
