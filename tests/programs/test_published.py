"""The published-runs table: facts with sources, specs the predict program accepts, the published step time each
row implies, and the error the planner prints beside its predictions (no compiles here: the validation itself is
pod-scale, `python -m benchmarks.published_validation`)."""
import pytest

from benchmarks import published_validation as pv
from models.presets import get_config
from partitioning.topology import parse_target
from workbench.programs import plan as wplan
from workbench.programs import predict as wp
from workbench.programs import validation
from workbench.results.store import Store, make_record


def test_table_has_sourced_runs_on_two_tpu_generations_and_h100():
    runs = validation.load_runs()
    assert len(runs) >= 8 and all(r.row["source"] for r in runs)
    assert {"tpu-v5e", "tpu-v5p", "h100"} <= {r.chip for r in runs}


@pytest.mark.parametrize("run", validation.load_runs(), ids=lambda r: r.name)
def test_every_row_is_a_valid_predict_spec(run):
    target, cfg, axes, batch, seq, _ = wp.prepare(run.spec())
    assert target.n_chips == int(run.row["n_chips"]) and batch == int(run.row["global_batch"])
    assert batch // int(run.row["n_chips"]) == int(run.row["per_device_batch"])
    assert cfg.d_model == int(run.row["d_model"]) and cfg.scan_layers
    # the block the framework ran: MaxText's default decoder layer (its 2023 family) is parallel
    assert cfg.block == run.row["block"] and cfg.residual_add == "stream"


def test_megatron_rows_pad_the_vocabulary_as_megatron_allocates_it():
    """NeMo (Megatron) pads the vocabulary to a multiple of 128 × the tensor-parallel size; the others keep it."""
    runs = {r.name: r for r in validation.load_runs()}
    assert runs["nemo-h100-gpt3-175b"].vocab_size() == 50688  # 50257 at TP 4
    assert runs["nemo-h100-llama2-70b"].vocab_size() == 32256
    assert runs["nemo-h100-llama3-8b"].vocab_size() == 128256  # TP 1: already a multiple of 128
    assert runs["maxtext-v5e-16b"].vocab_size() == 32768
    assert "vocab_size=50688" in runs["nemo-h100-gpt3-175b"].overrides()


def test_published_step_time_from_tflops_tokens_or_stated():
    runs = {r.name: r for r in validation.load_runs()}
    r32 = runs["maxtext-v5e-32b"]
    cfg = get_config("llama2-7b", r32.overrides())
    flops, _ = wp.model_flops(cfg, "train", 1024, 2048)
    step, how = r32.published_step(flops)
    # 132 TFLOP/s per chip on 256 chips: the step is the model's FLOPs at that rate (MFU 66.86 % of 197 TFLOP/s)
    assert step == pytest.approx(flops / (256 * 132e12)) and "TFLOP/s" in how
    assert flops / (256 * step) / 197e12 == pytest.approx(0.6686, rel=0.01), "the table's MFU and TFLOP/s agree"
    tt = runs["torchtitan-h100-llama3-8b"]
    step, how = tt.published_step(0.0)
    assert step == pytest.approx(2 * 8192 / 6667) and "tokens/s" in how


def test_planner_error_comes_from_the_latest_validation_record(results_dir):
    t = wp.topo.parse_target("tpu-v5e:4x4")
    assert wplan.prediction_error(t)["median_error"] is None
    rows = [{"chip": "tpu-v5e", "step_error": 0.10}, {"chip": "tpu-v5e", "step_error": -0.30},
            {"chip": "tpu-v5e", "step_error": 0.20}, {"chip": "h100", "step_error": None}]
    Store().append(make_record("published_validation", {}, extra=validation.summarize_errors(rows)))
    e = wplan.prediction_error(t)
    assert e["median_error"] == pytest.approx(0.20) and e["n_runs"] == 3 and "±20%" in e["text"]


def test_each_row_times_its_prediction_against_its_bare_compile(tmp_path):
    """A row's ratio is its whole prediction over build + lower + compile; the table says so per row, and two workers
    take the rows longest first: by the last report's wall times, else by chip count."""
    t = pv._timing({"build_and_lower_s": 1.0, "compile_s": 9.0}, 11.0)
    assert t["predict_over_compile"] == pytest.approx(1.1)
    assert pv._timing({"build_and_lower_s": 1.0, "compile_s": None}, 2.0)["predict_over_compile"] is None
    table = pv.timing_table([{"name": "a", **t}, {"name": "b", "wall_s": 1.0}], 60.0, "in-process")
    assert "| a | 1.0 s | 9.0 s | 11.0 s | 1.100 |" in table and "| b | — | — | 1.0 s | — |" in table
    assert "from 1.100 to 1.100" in table
    runs = validation.load_runs()[:3]
    targets = [parse_target(r.row["target"]) for r in runs]
    by_chips = pv._expected_seconds(str(tmp_path / "none.json"), runs, targets)
    assert by_chips == [float(t.n_chips) for t in targets]
    report = tmp_path / "last.json"
    report.write_text('{"runs": [{"name": "%s", "wall_s": 500.0}]}' % runs[1].name)
    last = pv._expected_seconds(str(report), runs, targets)
    assert last[1] == 500.0 and last[0] == pytest.approx(500.0 / targets[1].n_chips * targets[0].n_chips)
