"""Named model sizes, each citing the table it comes from. `get_config(preset, overrides)` -> ModelConfig."""
from __future__ import annotations

from models.config import ModelConfig, parse_overrides
from workbench.errors import WorkbenchError

_GPT = dict(mlp="gelu", norm="layernorm", pos="learned", bias=True, tie_embeddings=True)
_LLAMA = dict(mlp="swiglu", norm="rmsnorm", pos="rope", bias=False, tie_embeddings=False)
# Production-scale presets scan their layers (stacked parameters, one compiled layer body), as MaxText does by default
# (base.yml `scan_layers: True`): the compile time of a pod-scale step no longer grows with depth (llama3-8b for
# TPU v7x 4x4x4 compiles in minutes, not the better part of an hour, on a 2-core host). `--set scan_layers=false`
# gives the unrolled program.
_SCAN = dict(scan_layers=True)

# name -> (fields, source)
PRESETS: dict[str, tuple[dict, str]] = {
    "tiny": (dict(n_layers=2, d_model=64, n_heads=4, d_ff=256, vocab_size=256, seq_len=64, **_GPT),
             "workbench test model: byte-level vocabulary, compiles in seconds"),
    "tiny-moe": (dict(n_layers=2, d_model=64, n_heads=4, d_ff=128, vocab_size=256, seq_len=64, n_experts=8, top_k=2,
                      capacity_factor=1.25, **_GPT),
                 "workbench test model: `tiny` with a Mixtral-style 8-expert top-2 MLP (capacity factor 1.25)"),
    "small-moe": (dict(n_layers=4, d_model=256, n_heads=4, d_ff=512, vocab_size=256, seq_len=256, n_experts=8,
                       top_k=2, capacity_factor=1.25, n_kv_heads=2, **_LLAMA),
                  "workbench CPU study model: Mixtral-style (RMSNorm, RoPE, SwiGLU, GQA, 8 experts top-2) at "
                  "CPU scale"),
    "small": (dict(n_layers=4, d_model=512, n_heads=8, d_ff=2048, vocab_size=256, seq_len=256, scan_layers=True,
                   remat="dots", **_GPT),
              "workbench demo model: ~12.9M parameters, byte-level GPT-2 style; trains on a CPU host. Layers are "
              "scanned (on XLA:CPU the unrolled backward re-fuses the residual-stream gradient into every consumer) "
              "and save only their matmul outputs for the backward pass (docs/models.md); "
              "--set scan_layers=false,remat=none for the plain program"),
    "gpt2-small": (dict(n_layers=12, d_model=768, n_heads=12, d_ff=3072, vocab_size=50257, seq_len=1024, **_GPT),
                   "Radford et al. 2019, 'Language Models are Unsupervised Multitask Learners', Table 2 "
                   "(117M row; 124M with the released vocabulary); Hugging Face gpt2 config.json"),
    "gpt3-175b": (dict(n_layers=96, d_model=12288, n_heads=96, head_dim=128, d_ff=49152, vocab_size=50257,
                       seq_len=2048, **_GPT, **_SCAN),
                  "Brown et al. 2020, 'Language Models are Few-Shot Learners', Table 2.1 (GPT-3 175B)"),
    "llama2-7b": (dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, d_ff=11008, vocab_size=32000,
                       seq_len=4096, norm_eps=1e-5, **_LLAMA, **_SCAN),
                  "Touvron et al. 2023, 'Llama 2', Table 1; meta-llama/Llama-2-7b-hf config.json"),
    "llama2-70b": (dict(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672, vocab_size=32000,
                        seq_len=4096, norm_eps=1e-5, **_LLAMA, **_SCAN),
                   "Touvron et al. 2023, 'Llama 2', Table 1 (70B, grouped-query attention); "
                   "meta-llama/Llama-2-70b-hf config.json (8 kv heads, d_ff 28672)"),
    "palm-540b": (dict(n_layers=118, d_model=18432, n_heads=48, n_kv_heads=1, head_dim=256, d_ff=73728,
                       vocab_size=256000, seq_len=2048, mlp="swiglu", norm="layernorm", pos="rope", bias=False,
                       tie_embeddings=True, **_SCAN),
                  "Chowdhery et al. 2022, 'PaLM: Scaling Language Modeling with Pathways', Table 1 (540B: 118 layers, "
                  "d_model 18432, 48 heads) and Sec. 2 (SwiGLU, d_ff = 4 d_model, head size 256, multi-query "
                  "attention, RoPE, no biases, shared input/output embeddings, 256k vocabulary). Not modelled: the "
                  "parallel attention + MLP block (the same matmuls, serialised here)"),
    "llama3-8b": (dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=128256,
                       seq_len=8192, rope_theta=500000.0, **_LLAMA, **_SCAN),
                  "Llama Team 2024, 'The Llama 3 Herd of Models', Table 3; meta-llama/Meta-Llama-3-8B config.json"),
    "llama3-70b": (dict(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672, vocab_size=128256,
                        seq_len=8192, rope_theta=500000.0, **_LLAMA, **_SCAN),
                   "Llama Team 2024, 'The Llama 3 Herd of Models', Table 3; meta-llama/Meta-Llama-3-70B config.json"),
    "mixtral-8x7b": (dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=32000,
                          seq_len=32768, rope_theta=1e6, n_experts=8, top_k=2, **_LLAMA, **_SCAN),
                     "Jiang et al. 2024, 'Mixtral of Experts', Table 1; mistralai/Mixtral-8x7B-v0.1 config.json. "
                     "Layers scanned (as MaxText does): a pod-scale compile takes the time of one layer, not 32"),
    "deepseek-moe-16b": (dict(n_layers=28, d_model=2048, n_heads=16, n_kv_heads=16, head_dim=128, d_ff=1408,
                              vocab_size=102400, seq_len=4096, n_experts=64, top_k=6, n_shared_experts=2,
                              rope_theta=10000.0, scan_layers=True, **_LLAMA),
                         "Dai et al. 2024, 'DeepSeekMoE: Towards Ultimate Expert Specialization in Mixture-of-Experts "
                         "Language Models', Sec. 5 / Table 6 (DeepSeekMoE 16B: 28 layers, d 2048, 16 heads, 64 "
                         "fine-grained experts of 1408 + 2 shared, top-6); deepseek-ai/deepseek-moe-16b-base "
                         "config.json. Not modelled: its first layer is a dense MLP (d_ff 10944); here all 28 are MoE"),
}


def names() -> list[str]:
    return list(PRESETS)


def source(preset: str) -> str:
    _check(preset)
    return PRESETS[preset][1]


def _check(preset: str):
    if preset not in PRESETS:
        raise WorkbenchError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")


def get_config(preset: str, overrides: dict | str | None = None) -> ModelConfig:
    """The preset's config with `overrides` ('k=v,k=v' or a dict) applied and validated."""
    _check(preset)
    fields = dict(PRESETS[preset][0])
    fields.update(parse_overrides(overrides))
    return ModelConfig(**fields)
