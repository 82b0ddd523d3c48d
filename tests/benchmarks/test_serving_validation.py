"""The published serving table is well formed, and one stand-in row runs end to end (a tiny model on a small TPU
slice: the published rows' models take minutes each to compile)."""
import csv
import json

import pytest

from benchmarks import serving_validation as sv
from models.presets import get_config
from partitioning import topology as topo
from workbench.errors import WorkbenchError
from workbench.results.store import Store


def test_every_published_row_is_complete_and_parses():
    rows = sv.load_rows()
    assert len(rows) >= 8
    assert len({r["chip"] for r in rows}) >= 3
    for r in rows:
        assert set(sv.FIELDS) <= set(r), r["name"]
        for k in sv.REQUIRED:
            assert r[k].strip(), (r["name"], k)
        cfg = get_config(r["model"], r["overrides"] or None)
        assert cfg.n_layers >= 1
        t = topo.parse_target(r["target"])
        assert r["chip"].split("-")[-1] in t.family or t.family in r["chip"], (r["name"], r["chip"], t.family)
        assert r["metric"] in sv.METRICS and float(r["value"]) > 0
        assert r["quant"] in ("none", "int8", "int4", "fp8") and r["kv_dtype"] in ("auto", "bf16", "int8", "fp8")
        assert len(r["source"]) > 20 and r["commit"].strip() and r["date"].strip()
        sv.spec_of(r)  # builds a ServeSpec


def test_metric_conversion():
    assert sv.convert("decode_s", 64, 64, 64, None, 0.03) == pytest.approx(1.92)
    assert sv.convert("out_tokens_per_s_total", 128, 1024, 8, None, 0.05) == pytest.approx(2560)
    # a static batch: one prefill then gen_len - 1 decode steps, per chip
    assert sv.convert("out_tokens_per_s_per_chip", 8, 11, 2, 1.0, 0.1) == pytest.approx(8 * 11 / 2.0 / 2)


def test_a_bad_table_is_one_line(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text(",".join(sv.FIELDS) + "\n" + ",".join(["x"] * len(sv.FIELDS)) + "\n")
    with pytest.raises(WorkbenchError, match="unknown metric"):
        sv.load_rows(str(p))


@pytest.mark.compile_heavy
@pytest.mark.skipif(not topo.libtpu_available(), reason="libtpu not installed")
def test_a_stand_in_row_end_to_end(tmp_path, results_dir, capsys):
    row = dict(name="stand-in", framework="test", chip="tpu-v5e", target="tpu-v5e:2x2", model="tiny", overrides="",
               strategy="tp", mesh="model=4", batch="8", prompt_len="16", gen_len="8", quant="int8", kv_dtype="auto",
               metric="out_tokens_per_s_per_chip", value="1000", unit="output tokens/s per chip",
               source="a stand-in for the published rows", commit="none", date="2026-01-01", notes="")
    table = tmp_path / "serving.csv"
    with open(table, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sv.FIELDS)
        w.writeheader()
        w.writerow(row)
    assert sv.main(["--table", str(table), "--json", "--out", str(tmp_path / "out.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    (r,) = out["rows"]
    assert r["compiled"] and r["fits"] and r["chips"] == 4
    assert r["predicted_ttft_s"] > 0 and r["predicted_tpot_s"] > 0
    assert r["predicted"] == pytest.approx(8 * 8 / (r["predicted_ttft_s"] + 7 * r["predicted_tpot_s"]) / 4)
    assert r["error"] == pytest.approx(r["predicted"] / 1000 - 1)
    assert out["n_compared"] == 1 and set(out["median_error_by_chip"]) == {"tpu-v5e"}
    recs = Store().records("serving_validation")
    assert recs and recs[-1]["extra"]["name"] == "stand-in"
