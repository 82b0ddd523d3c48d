"""Remat policies by name (models/remat.py): each keeps exactly its tagged tensors, and none changes the gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from models.config import parse_overrides
from models.layers import Block
from models.precision import get_policy
from models.presets import get_config
from models.remat import REMATS, parse_remat
from models.transformer import Transformer, remat_block
from workbench.errors import WorkbenchError
from workbench.testing import assert_close

QKV = {"query_proj", "key_proj", "value_proj"}
# what the backward pass of one SwiGLU block reads under each policy (kept on the device, and copied to host memory).
# mlpwo is never among them: the block's last matmul feeds only the next layer's input, the checkpoint itself.
KEPT = {
    "none": None,
    "full": (set(), 0),
    "per-layer": (set(), 0),
    "save_qkv_proj": (QKV, 0),
    "save_out_proj": ({"out_proj"}, 0),
    "save_dot_except_mlp": (QKV | {"out_proj"}, 0),
    "save_dot_except_mlpwi": (QKV | {"out_proj"}, 0),
    "save_dot_with_context_except_mlp": (QKV | {"out_proj", "context"}, 0),
    "minimal": (QKV | {"out_proj", "mlpwi_0", "mlpwi_1"}, 0),
    "minimal_with_context": (QKV | {"out_proj", "mlpwi_0", "mlpwi_1", "context"}, 0),
    "qkv_proj_offloaded": (set(), 3),
    "minimal_offloaded": (set(), 6),
    "offload": (set(), 4),
    "torchtitan_selective_op": ({"query_proj", "value_proj", "context", "mlpwi_0"}, 0),
    "decoder_layer_input=offload,query_proj=device": ({"query_proj"}, 1),
    "context=device,mlpwi_0=offload,mlpwi_1=remat": ({"context"}, 1),
}


def _block_residuals(remat: str, mlp: str = "swiglu"):
    """(names kept on the device, count kept in host memory, bytes kept) by the backward pass of one block."""
    cfg = get_config("tiny", f"seq_len=16,mlp={mlp}").replace(remat=remat)
    g, st = nnx.split(Block(cfg, get_policy("float32"), nnx.Rngs(0)))
    x = jnp.ones((2, 16, cfg.d_model))
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    call = remat_block(remat)

    def f(st, x):
        return call(nnx.merge(g, st), x, pos)[0].sum()

    names, host, nbytes = set(), 0, 0
    for aval, what in saved_residuals(f, st, x):
        if "argument" in what:
            continue
        nbytes += aval.size * aval.dtype.itemsize
        if "<host>" in aval.str_short():
            host += 1
        elif "named '" in what:
            names.add(what.split("named '")[1].split("'")[0])
    return names, host, nbytes


@pytest.mark.parametrize("remat", [r for r in KEPT if KEPT[r] is not None])
def test_each_policy_keeps_exactly_its_tensors(remat):
    names, host, _ = _block_residuals(remat)
    assert (names, host) == KEPT[remat]


def test_gelu_mlp_input_is_kept_as_mlpwi():
    assert _block_residuals("minimal", mlp="gelu")[0] == QKV | {"out_proj", "mlpwi"}
    assert _block_residuals("save_dot_except_mlpwi", mlp="gelu")[0] == QKV | {"out_proj"}


def test_kept_bytes_are_ordered_as_the_policies():
    b = {r: _block_residuals(r)[2] for r in ("full", "save_qkv_proj", "save_dot_except_mlpwi", "minimal")}
    assert b["full"] < b["save_qkv_proj"] < b["save_dot_except_mlpwi"] < b["minimal"]


def test_every_name_is_covered():
    assert set(REMATS) - {"dots"} <= set(KEPT)  # dots keeps every matmul output, named or not


@pytest.mark.parametrize("remat,scan", [("full", True), ("minimal", False), ("save_dot_except_mlpwi", True),
                                        ("save_qkv_proj", False), ("save_out_proj", False),
                                        ("minimal_with_context", True), ("qkv_proj_offloaded", False),
                                        ("minimal_offloaded", True), ("torchtitan_selective_op", False),
                                        ("decoder_layer_input=offload,query_proj=offload", True)])
def test_policies_give_the_gradients_of_no_remat(remat, scan):
    cfg = get_config("tiny", f"n_layers=2,seq_len=16,scan_layers={str(scan).lower()},mlp=swiglu,pos=rope")
    tok = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)

    def grads(c):
        m = Transformer(c, None, nnx.Rngs(0))
        return nnx.jit(nnx.grad(lambda m: jnp.square(m(tok)[0].astype(jnp.float32)).mean()))(m)

    g0, g1 = grads(cfg), grads(cfg.replace(remat=remat))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        assert_close(a, b, "float32")


def test_bf16_kept_projections_are_stored_in_the_compute_dtype():
    """A float32 output (out_proj, mlpwo feed the float32 residual stream) is kept in the compute dtype, as MaxText
    keeps it."""
    cfg = get_config("tiny", "seq_len=16,mlp=swiglu").replace(remat="save_out_proj")
    g, st = nnx.split(Block(cfg, get_policy("bf16"), nnx.Rngs(0)))
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))

    def f(st, x):
        return remat_block(cfg.remat)(nnx.merge(g, st), x, pos)[0].sum()

    kept = [aval for aval, what in saved_residuals(f, st, jnp.ones((2, 16, cfg.d_model))) if "'out_proj'" in what]
    assert [a.dtype for a in kept] == [jnp.bfloat16]


@pytest.mark.parametrize("text,words", [
    ("sometimes", "unknown remat policy 'sometimes'"),
    ("query=offload", "unknown remat tensor 'query'"),
    ("query_proj=host", "choose remat, device, offload"),
    ("decoder_layer_input=remat", "cannot be rematerialized"),
    ("query_proj=device,query_proj=offload", "given twice"),
    ("query_proj", "unknown remat policy"),
])
def test_bad_policies_are_one_line(text, words):
    with pytest.raises(WorkbenchError) as e:
        parse_remat(text)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_custom_policy_reads_from_set_and_is_canonical():
    o = parse_overrides("remat=query_proj=offload,decoder_layer_input=offload,n_layers=2")
    assert o == {"remat": "query_proj=offload,decoder_layer_input=offload", "n_layers": 2}
    p = parse_remat(o["remat"])
    assert p.name == "decoder_layer_input=offload,query_proj=offload" and p.offload == ("decoder_layer_input",
                                                                                        "query_proj")
    assert parse_remat("query_proj=device;key_proj=device").save == ("query_proj", "key_proj")
    assert parse_remat("per-layer").kind == parse_remat("full").kind == "full"
