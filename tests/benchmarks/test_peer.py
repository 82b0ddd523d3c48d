"""benchmarks.peer: the PyTorch model is the workbench's model (skipped without torch; torch is never required)."""
import math

import jax
import numpy as np
import optax
import pytest

import benchmarks.peer as peer
from models.presets import get_config
from models.transformer import Transformer, count_params


def test_lr_schedule_is_the_workbench_schedule():
    """The PyTorch side's learning rates are the optax schedule of workbench.programs.step.make_optimizer."""
    for lr, total in ((1e-3, 1000), (3e-3, 40), (1e-3, 5)):
        warmup = min(100, max(total // 10, 1))
        ref = optax.warmup_cosine_decay_schedule(lr / (warmup + 1), lr, warmup, max(total, warmup + 1),
                                                 end_value=0.1 * lr)
        got = peer.lr_schedule(lr, total)
        want = np.array([float(ref(s)) for s in range(total + 1)])
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_without_torch_it_says_how_to_install_and_exits_cleanly(monkeypatch, capsys):
    monkeypatch.setattr(peer, "torch", None)
    assert peer.main(["--tiny"]) is None
    err = capsys.readouterr().err
    assert "pip install -e .[peer]" in err and "skipped" in err


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_torch_model_has_the_workbench_parameter_count(preset):
    pytest.importorskip("torch")
    cfg = get_config(preset)
    n_wb = count_params(jax.eval_shape(lambda: Transformer(cfg)))
    assert peer.torch_param_count(peer.TorchGPT(cfg)) == n_wb


def test_torch_model_starts_where_the_workbench_starts():
    """Same initialisation scales: both models' first loss on the same batch is below ln(256) (uniform over bytes) by
    the same amount within 0.05 nats (tied embeddings: an input byte's own logit is high, and source code repeats bytes),
    and differs from a model with 10x larger embeddings."""
    torch = pytest.importorskip("torch")
    cfg = get_config("tiny")
    b = peer.Batches(4, cfg.seq_len, 0).train(0)
    torch.manual_seed(0)
    x, y = torch.from_numpy(b["inputs"]).long(), torch.from_numpy(b["targets"]).long().reshape(-1)
    model = peer.TorchGPT(cfg)
    with torch.no_grad():
        l_torch = float(torch.nn.functional.cross_entropy(model(x).reshape(-1, cfg.vocab_size), y))
        model.wte.weight.mul_(10.0)
        l_big = float(torch.nn.functional.cross_entropy(model(x).reshape(-1, cfg.vocab_size), y))
    logits_wb, _ = Transformer(cfg)(b["inputs"])
    l_wb = float(optax.softmax_cross_entropy_with_integer_labels(logits_wb, b["targets"]).mean())
    assert l_torch < math.log(256) and l_wb < math.log(256), (l_torch, l_wb)
    assert abs(l_torch - l_wb) < 0.05 and abs(l_big - l_wb) > 0.5, (l_torch, l_wb, l_big)


def test_torch_peer_refuses_configs_it_does_not_implement():
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="GPT-2 style"):
        peer.TorchGPT(get_config("tiny", "mlp=swiglu"))
