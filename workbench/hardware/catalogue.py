"""Hardware catalogue: published per-chip figures for the accelerators the workbench predicts on, each with its source.

Pure data (no JAX import). `workbench.hardware.spec` turns each entry into a `HardwareSpec`; this module only states facts.

Each figure is a tuple ``(value, source, date_read, note)``:
  value      the number in SI units (FLOP/s, bytes, bytes/s, seconds, results/s) or a count/shape; None when the
             vendor does not publish it (the note then says so),
  source     the URL or document title the value was checked against,
  date_read  YYYY-MM-DD, the day it was checked against the stored copy of that page (the note says when no stored
             copy of the vendor page could be found and which copy was used instead),
  note       how the value was derived from the page (unit conversion, sparse→dense, per-system→per-chip), and where
             sources disagree, the other figure.

Conventions (they matter for every consumer):
  * peak_flops are DENSE (no 2:4 structured sparsity) and per chip. NVIDIA's tensor-core tables print sparse figures
    with a footnote; those are halved here and the note says so. Keys are dtype names: float32, tf32, bfloat16,
    float16, int8 (ops/s), float8_e4m3fn, float8_e5m2 (OCP FP8), float8_e4m3fnuz / float8_e5m2fnuz (AMD CDNA3 FP8),
    float4_e2m1fn. A dtype a chip has no units for is absent (hardware.HardwareSpec.peak falls back to a wider one).
  * GPU float32 is the non-tensor (CUDA-core / vector ALU) FMA rate, counting an FMA as 2 FLOPs; "tf32" is the
    tensor-core rate for float32 inputs rounded to TF32. TPU float32 is derived (see TPU_F32_NOTE).
  * Byte capacities follow the unit the vendor printed: "GB" → 1e9, "GiB" → 2**30.
  * Interconnect link_bw is bytes/s ONE WAY PER LINK; per-chip one-way bandwidth = link_bw × links. Vendors usually
    print bidirectional per-chip totals; the notes show the division.
  * host_link_bw is the host (PCIe) link, bytes/s one way. scale_out_bw is the per-chip one-way share of the
    scale-out network (InfiniBand/RoCE NIC per GPU; DCN per TPU chip).
  * aliases hold, besides short names, the device kind JAX reports for the chip (`jax.devices()[0].device_kind`),
    matched case-insensitively: this is the one map from a running device to its entry. TPU kinds as
    jax/_src/tpu_info.py matches them ("TPU v4", "TPU v5 lite", "TPU v5", "TPU v6 lite", "TPU7x"); NVIDIA and AMD
    kinds are the driver's device name as `nvidia-smi --query-gpu=name` / rocm-smi print it ("NVIDIA H200" as
    seen on an H200 SXM). A PCIe or NVL part (e.g. "NVIDIA H100 PCIe") is another chip and matches no entry.
"""
from __future__ import annotations

READ = "2026-11-29"  # the day these figures were checked against the stored copies of the pages below

# ---- sources (addresses of the pages checked) ----
CLOUD_TPU_V4 = "https://cloud.google.com/tpu/docs/v4"
CLOUD_TPU_V5E = "https://cloud.google.com/tpu/docs/v5e"
CLOUD_TPU_V5P = "https://cloud.google.com/tpu/docs/v5p"
CLOUD_TPU_V6E = "https://cloud.google.com/tpu/docs/v6e"
SCALING_TPUS = "https://jax-ml.github.io/scaling-book/tpus/ (How to Think About TPUs; repo jax-ml/scaling-book tpus.md)"
SCALING_GPUS = "https://jax-ml.github.io/scaling-book/gpus/ (How to Think About GPUs; repo jax-ml/scaling-book gpus.md)"
TPU_V4_PAPER = ("Jouppi et al., TPU v4: An Optically Reconfigurable Supercomputer for Machine Learning with Hardware "
                "Support for Embeddings, ISCA 2023, https://arxiv.org/abs/2304.01433")
NV_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
NV_H100 = "https://www.nvidia.com/en-us/data-center/h100/"
NV_H200 = "https://www.nvidia.com/en-us/data-center/h200/"
NV_HGX = "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200 technical specifications)"
NV_DGX_B200 = "https://www.nvidia.com/en-us/data-center/dgx-b200/"
NV_DGX_A100 = "https://www.nvidia.com/en-us/data-center/dgx-a100/"
NV_DGX_H100 = "https://docs.nvidia.com/dgx-superpod/reference-architecture-scalable-infrastructure-h100/latest/network-fabrics.html"
CUDA_GUIDE = ("CUDA C++ Programming Guide, 'Arithmetic Instructions' table (results per clock per SM), "
              "https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#arithmetic-instructions")
NV_MATMUL_GUIDE = ("NVIDIA Matrix Multiplication Background User's Guide, 'Tensor Core Requirements', "
                   "https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/index.html")
NCCL_TUNING = "NVIDIA/nccl src/graph/tuning.cc, hwLat table (https://github.com/NVIDIA/nccl)"
AMD_MI300X = "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"
ROCM_SPECS = "https://rocm.docs.amd.com/en/latest/reference/gpu-specs.html"
MODULAR_TC = "https://docs.modular.com/mojo/kernels/layout/tensor_core (supported AMD/NVIDIA MMA shapes)"
AZURE_ND_MI300X = ("Azure ND MI300X v5-series, https://learn.microsoft.com/azure/virtual-machines/sizes/gpu-accelerated/"
                   "nd-mi300x-v5-series (MicrosoftDocs/azure-docs)")

NO_STORED_NV = ("No stored copy of the NVIDIA page was found; value checked against copies that reproduce NVIDIA's "
                "table (glennklockwood.com/garden/processors, scaling book gpus.md) and the DESIGN.md table. ")
NO_STORED_AMD = ("No stored copy of the AMD page was found; value checked against copies that reproduce AMD's "
                 "figures (e.g. alpharomercoma/MI300X-vs-H200 METHODOLOGY.md, vultr ROCm docs) and DESIGN.md. ")

TPU_F32_NOTE = ("Derived, not published: TPU MXUs multiply bf16; a true-float32 matmul (Precision.HIGHEST, the "
                "BF16_BF16_F32_X6 algorithm) takes 6 bf16 passes, so bf16 peak / 6. JAX's DEFAULT precision runs a "
                "float32 matmul as ONE bf16 pass (bf16 rate, bf16 rounding) and HIGH as 3 passes (bf16 peak / 3); "
                "price by the precision the program actually uses. Source for the pass counts: "
                "https://docs.jax.dev/en/latest/201/precision.html")
TPU_LATENCY_NOTE = ("Per-hop ICI latency of ~1 us is the assumption the scaling book uses in its TPU v5e worked "
                    "problem (Question 5); Google publishes no per-hop figure. An estimate, not a spec.")
NCCL_LAT_NOTE = ("NCCL's cost model charges 3.4 us per ring step over NVLink with the Simple protocol (full "
                 "bandwidth) plus a base 8.4 us per collective; the LL protocol (small messages) is 0.47 us per step "
                 "at ~1/4 bandwidth. Read from the tuning.cc version stored in the index (Volta/Ampere era); newer "
                 "NCCL versions retune these. An estimate, not a spec.")
SFU_NOTE = ("16 results/clock/SM for 32-bit reciprocal, rsqrt, log2, exp2, sin, cos (CUDA guide table). The only "
            "stored copy found is a translation that stops at the cc 7.x column (16); the 16 for cc 8.0/9.0 is the "
            "current guide's value as known, not re-read here. ")


def _t(value, source, note="", date=READ):
    return (value, source, date, note)


CHIPS = {
    # ------------------------------------------------------------------ Google TPUs
    "tpu-v4": {
        "vendor": "Google", "kind": "tpu", "aliases": ["v4", "tpuv4", "v4p", "tpu-v4p", "TPU v4"],
        "tpu_generation": "v4",
        "peak_flops": {
            "bfloat16": _t(2.75e14, CLOUD_TPU_V4, "'Peak compute per chip: 275 teraflops (bf16 or int8)'."),
            "int8": _t(2.75e14, CLOUD_TPU_V4, "Same page: 275 (bf16 or int8); v4 has no faster int8 path."),
            "float32": _t(2.75e14 / 6, CLOUD_TPU_V4, TPU_F32_NOTE),
        },
        "hbm_bytes": _t(32 * 2**30, CLOUD_TPU_V4, "'HBM2 capacity and bandwidth: 32 GiB, 1200 GBps'."),
        "hbm_bw": _t(1.2e12, CLOUD_TPU_V4, "'32 GiB, 1200 GBps'. Scaling book table: 1.2e12."),
        "onchip_bytes": _t(128 * 2**20, TPU_V4_PAPER,
                           "CMEM (on-chip memory shared by the two TensorCores) 128 MiB. Per-core VMEM (~32 MiB, "
                           "third-party figure) not added. Paper not in the stored index; value as reported by "
                           "secondary pages (brendanjameslynskey.github.io Google TPU series)."),
        "interconnect": {
            "kind": "ici-torus-3d",
            "link_bw": _t(4.5e10, SCALING_TPUS,
                          "Scaling book 'ICI BW/link (one-way)' for TPU v4p: 4.5e10 (bidi 9e10). The Cloud v4 page "
                          "gives pod totals only (all-reduce 1.1 PB/s, bisection 24 TB/s)."),
            "links": _t(6, SCALING_TPUS, "3D torus: nearest 6 neighbours (scaling book 'TPU Networking'); "
                        "Cloud page: '3D mesh', torus with wraparound on full-cube slices."),
            "latency_s": _t(1e-6, SCALING_TPUS, TPU_LATENCY_NOTE),
            "scale_out_bw": _t(6.25e9, SCALING_TPUS,
                               "Scaling book: DCN 'typically around 6.25e9 bytes/s per TPU' (generic figure; the v4 "
                               "page publishes no per-chip DCN number)."),
        },
        "host_link_bw": _t(1.6e10, SCALING_TPUS,
                           "Scaling book: PCIe 'typically around 1.6e10 bytes/s per TPU'; an earlier revision says "
                           "'16GB/s each way' for v4 specifically."),
        "matrix_unit": _t((128, 128), SCALING_TPUS, "128x128 systolic MXU (4 per TensorCore, 2 TensorCores)."),
        "transcendentals_per_s": _t(None, SCALING_TPUS, "Not published for any TPU."),
    },
    "tpu-v5e": {
        "vendor": "Google", "kind": "tpu", "aliases": ["v5e", "v5litepod", "v5lite", "tpu-v5-lite", "tpu-v5litepod",
                                             "TPU v5 lite", "TPU v5e"],
        "tpu_generation": "v5e",
        "peak_flops": {
            "bfloat16": _t(1.97e14, CLOUD_TPU_V5E, "'Peak compute per chip (bf16): 197 TFLOPs'."),
            "int8": _t(3.93e14, CLOUD_TPU_V5E, "'Peak compute per chip (Int8): 393 TOPs'. Scaling book rounds to "
                       "3.94e14; an older revision of the page gives only the pod figure (100 PetaOps)."),
            "float32": _t(1.97e14 / 6, CLOUD_TPU_V5E, TPU_F32_NOTE),
        },
        "hbm_bytes": _t(16e9, CLOUD_TPU_V5E, "'HBM2 capacity and bandwidth: 16 GB, 819 GBps' (printed as GB; the "
                        "scaling book says 16GiB)."),
        "hbm_bw": _t(8.19e11, CLOUD_TPU_V5E, "'16 GB, 819 GBps'. A newer revision of the page prints 'HBM bandwidth "
                     "per chip 800 GiBps' (8.59e11), inconsistent with 819 GB/s; scaling book uses 8.1e11."),
        "onchip_bytes": _t(128 * 2**20, SCALING_TPUS, "VMEM 'for example, 128 MiB on TPU v5e' (one TensorCore)."),
        "interconnect": {
            "kind": "ici-torus-2d",
            "link_bw": _t(4.5e10, SCALING_TPUS,
                          "Scaling book 'ICI BW/link (one-way)': 4.5e10 (bidi 9e10). The Cloud page gives 400 GBps "
                          "bidirectional per chip over 4 ports = 50 GB/s one way per port; the scaling book notes "
                          "links run slightly below the page figure and uses 4.5e10 (an earlier revision used 5e10)."),
            "links": _t(4, CLOUD_TPU_V5E, "'ICI ports per chip: 4'; 2D torus (wraparound only on 16-long axes)."),
            "latency_s": _t(1e-6, SCALING_TPUS, TPU_LATENCY_NOTE),
            "scale_out_bw": _t(3.125e9, SCALING_TPUS,
                               "Scaling book: DCN 3.125e9 bytes/s per v5e TPU; agrees with the Cloud page's "
                               "'Per-host NIC configuration: 2 x 100 Gbps NIC' over 8 chips per host."),
        },
        "host_link_bw": _t(1.6e10, SCALING_TPUS, "Scaling book: PCIe ~1.6e10 bytes/s per TPU."),
        "matrix_unit": _t((128, 128), CLOUD_TPU_V5E, "Four 128x128 MXUs per TensorCore (page: 'four MXUs'; size from "
                          "the scaling book)."),
        "transcendentals_per_s": _t(None, SCALING_TPUS, "Not published for any TPU."),
    },
    "tpu-v5p": {
        "vendor": "Google", "kind": "tpu", "aliases": ["v5p", "tpu-v5", "TPU v5", "TPU v5p"], "tpu_generation": "v5p",
        "peak_flops": {
            "bfloat16": _t(4.59e14, CLOUD_TPU_V5P, "'Peak compute per chip (BF16): 459 TFLOPs'."),
            "int8": _t(9.18e14, SCALING_TPUS, "Scaling book table: int8 9.18e14 (2x bf16); the current Cloud page "
                       "lists no int8 figure."),
            "float8_e4m3fn": _t(4.59e14, CLOUD_TPU_V5P, "Current page lists 'Peak compute per chip (FP8) (TFLOPs): "
                                "459', i.e. FP8 runs at the bf16 rate (no FP8 speed-up on v5p)."),
            "float8_e5m2": _t(4.59e14, CLOUD_TPU_V5P, "As float8_e4m3fn: the page's FP8 figure equals bf16."),
            "float32": _t(4.59e14 / 6, CLOUD_TPU_V5P, TPU_F32_NOTE),
        },
        "hbm_bytes": _t(95 * 2**30, CLOUD_TPU_V5P, "'HBM capacity per chip (GiB): 95' (older revision: '95 GB'; "
                        "scaling book: 96GB)."),
        "hbm_bw": _t(2.765e12, CLOUD_TPU_V5P, "'2765 GBps' (another revision: '2575 GiBps' = 2.765e12 B/s, "
                     "consistent). Scaling book rounds to 2.8e12."),
        "onchip_bytes": _t(128e6, SCALING_GPUS, "Scaling book GPU chapter comparison table: TPU v5p VMEM '128MB' "
                           "(both TensorCores). Google publishes no VMEM size for v5p."),
        "interconnect": {
            "kind": "ici-torus-3d",
            "link_bw": _t(9e10, SCALING_TPUS,
                          "Scaling book 'ICI BW/link (one-way)': 9e10 (bidi 1.8e11). Cloud page: 'Bidirectional ICI "
                          "bandwidth per chip 1200 GBps' over 6 links = 100 GB/s one way per link; the scaling book "
                          "notes the page lists 100 GB/s and uses 90 (an earlier revision used 1e11)."),
            "links": _t(6, SCALING_TPUS, "3D torus, nearest 6 neighbours; Cloud page: '3D torus'."),
            "latency_s": _t(1e-6, SCALING_TPUS, TPU_LATENCY_NOTE),
            "scale_out_bw": _t(6.25e9, CLOUD_TPU_V5P, "'Data center network (DCN) bandwidth per chip (Gbps): 50' = "
                               "6.25e9 B/s; scaling book: 6.25e9."),
        },
        "host_link_bw": _t(1.6e10, SCALING_TPUS, "Scaling book: PCIe ~1.6e10 bytes/s per TPU."),
        "matrix_unit": _t((128, 128), CLOUD_TPU_V5P, "'Each TensorCore has four MXUs'; 128x128 (scaling book)."),
        "transcendentals_per_s": _t(None, SCALING_TPUS, "Not published for any TPU."),
    },
    "tpu-v6e": {
        "vendor": "Google", "kind": "tpu", "aliases": ["v6e", "trillium", "tpu-trillium", "v6", "TPU v6 lite", "TPU v6e"],
        "tpu_generation": "v6e",
        "peak_flops": {
            "bfloat16": _t(9.18e14, CLOUD_TPU_V6E, "'Peak compute per chip (bf16): 918 TFLOPs'. Scaling book: "
                           "9.20e14."),
            "int8": _t(1.836e15, CLOUD_TPU_V6E, "'Peak compute per chip (Int8): 1836 TOPs'."),
            "float32": _t(9.18e14 / 6, CLOUD_TPU_V6E, TPU_F32_NOTE),
        },
        "hbm_bytes": _t(32e9, CLOUD_TPU_V6E, "'HBM capacity per chip: 32 GB'."),
        "hbm_bw": _t(1.638e12, CLOUD_TPU_V6E, "'HBM bandwidth per chip: 1638 GBps'. Scaling book: 1.6e12."),
        "onchip_bytes": _t(None, CLOUD_TPU_V6E, "VMEM size for v6e is not published."),
        "interconnect": {
            "kind": "ici-torus-2d",
            "link_bw": _t(9e10, SCALING_TPUS,
                          "Scaling book 'ICI BW/link (one-way)': 9e10 (bidi 1.8e11). Cloud page: 800 GBps "
                          "bidirectional per chip over 4 ports = 100 GB/s one way per port."),
            "links": _t(4, CLOUD_TPU_V6E, "'ICI ports per chip: 4'; 'Interconnect topology: 2D torus'."),
            "latency_s": _t(1e-6, SCALING_TPUS, TPU_LATENCY_NOTE),
            "scale_out_bw": _t(1.25e10, SCALING_TPUS, "Scaling book: DCN 12.5e9 bytes/s per v6e TPU."),
        },
        "host_link_bw": _t(3.2e10, SCALING_TPUS, "Scaling book: PCIe 3.2e10 for v6e (Cloud page: 'PCIe Gen5 "
                           "interface')."),
        "matrix_unit": _t((256, 256), CLOUD_TPU_V6E, "'two 256x256 matrix-multiply units (MXU)' per TensorCore."),
        "transcendentals_per_s": _t(None, SCALING_TPUS, "Not published for any TPU."),
    },
    # ------------------------------------------------------------------ NVIDIA
    "a100-80gb": {
        "vendor": "NVIDIA", "kind": "gpu", "aliases": ["a100", "a100-sxm", "a100-sxm4-80gb", "a100-80gb-sxm", "NVIDIA A100-SXM4-80GB"],
        "peak_flops": {
            "float32": _t(1.95e13, NV_A100, NO_STORED_NV + "FP32 19.5 TFLOPS (CUDA cores, FMA = 2 FLOPs)."),
            "tf32": _t(1.56e14, NV_A100, NO_STORED_NV + "TF32 Tensor Core 156 TFLOPS dense (312 with sparsity)."),
            "bfloat16": _t(3.12e14, NV_A100, NO_STORED_NV + "BF16 Tensor Core 312 TFLOPS dense (624 sparse)."),
            "float16": _t(3.12e14, NV_A100, NO_STORED_NV + "FP16 Tensor Core 312 TFLOPS dense (624 sparse)."),
            "int8": _t(6.24e14, NV_A100, NO_STORED_NV + "INT8 Tensor Core 624 TOPS dense (1248 sparse). No FP8."),
        },
        "hbm_bytes": _t(80e9, NV_A100, NO_STORED_NV + "'80GB HBM2e' (SXM)."),
        "hbm_bw": _t(2.039e12, NV_A100, NO_STORED_NV + "A100 80GB SXM: 2,039 GB/s (PCIe 80GB: 1,935 GB/s)."),
        "onchip_bytes": _t(108 * 192 * 1024 + 40 * 2**20, SCALING_GPUS,
                           "SMEM+L2: 108 SMs x 192 kB combined L1/shared memory + 40 MB L2 (scaling book 'Summary of "
                           "GPU specs'). Registers (256 kB/SM) not included."),
        "interconnect": {
            "kind": "nvlink",
            "link_bw": _t(2.5e10, SCALING_GPUS, "NVLink 3.0: 25 GB/s each way per link (scaling book NVLink table); "
                          "NVIDIA: 600 GB/s per GPU bidirectional = 12 x 25 x 2."),
            "links": _t(12, SCALING_GPUS, "12 NVLink ports per A100 (scaling book table), via 6 NVSwitches "
                        "(DGX A100)."),
            "latency_s": _t(3.4e-6, NCCL_TUNING, NCCL_LAT_NOTE),
            "scale_out_bw": _t(2.5e10, NV_DGX_A100, "DGX A100: 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand, one "
                               "per GPU = 2.5e10 B/s one way. System-dependent. No stored copy of the DGX page found."),
        },
        "host_link_bw": _t(3.2e10, NV_A100, NO_STORED_NV + "'PCIe Gen4: 64GB/s' (both directions) = 32 GB/s one way."),
        "matrix_unit": _t((64, 64), NV_MATMUL_GUIDE,
                          "Tensor Cores run best when M, N, K are multiples of 128 bytes on A100 (64 elements of a "
                          "2-byte type); the minimum for Tensor Core use is 16 bytes (8 fp16). Shape stated in 2-byte "
                          "elements. Only the guide's table of contents was in the stored copy; rule from the guide."),
        "transcendentals_per_s": _t(16 * 108 * 1.41e9, CUDA_GUIDE,
                                    SFU_NOTE + "x 108 SMs x 1.41 GHz boost (A100 datasheet/scaling book clock table) "
                                    "= 2.44e12 results/s."),
    },
    "h100-sxm": {
        "vendor": "NVIDIA", "kind": "gpu", "aliases": ["h100", "h100-sxm5", "h100-80gb", "h100-sxm5-80gb", "NVIDIA H100 80GB HBM3"],
        "peak_flops": {
            "float32": _t(6.7e13, NV_H100, NO_STORED_NV + "H100 SXM FP32 67 TFLOPS (CUDA cores)."),
            "tf32": _t(4.945e14, NV_H100, NO_STORED_NV + "TF32 Tensor Core 989 TFLOPS with sparsity -> 494.5 dense."),
            "bfloat16": _t(9.895e14, NV_H100, NO_STORED_NV + "BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989.5 "
                           "dense (scaling book: 9.9e14)."),
            "float16": _t(9.895e14, NV_H100, NO_STORED_NV + "FP16 Tensor Core 1,979 sparse -> 989.5 dense."),
            "float8_e4m3fn": _t(1.979e15, NV_H100, NO_STORED_NV + "FP8 Tensor Core 3,958 TFLOPS with sparsity -> "
                                "1,979 dense."),
            "float8_e5m2": _t(1.979e15, NV_H100, NO_STORED_NV + "Same FP8 rate for E5M2."),
            "int8": _t(1.979e15, NV_H100, NO_STORED_NV + "INT8 Tensor Core 3,958 TOPS sparse -> 1,979 dense."),
        },
        "hbm_bytes": _t(80e9, NV_H100, NO_STORED_NV + "'80GB' HBM3."),
        "hbm_bw": _t(3.35e12, NV_H100, NO_STORED_NV + "'3.35TB/s'."),
        "onchip_bytes": _t(132 * 256 * 1024 + 50 * 2**20, SCALING_GPUS,
                           "SMEM+L2: 132 SMs x 256 kB L1/shared memory + 50 MB L2 (scaling book). Registers not "
                           "included."),
        "interconnect": {
            "kind": "nvlink",
            "link_bw": _t(2.5e10, SCALING_GPUS, "NVLink 4.0: 25 GB/s each way per link; NVIDIA: 900 GB/s per GPU "
                          "bidirectional = 18 x 25 x 2 (450 GB/s egress)."),
            "links": _t(18, SCALING_GPUS, "18 NVLink ports per H100 into 4 NVSwitches (8-GPU node)."),
            "latency_s": _t(3.4e-6, NCCL_TUNING, NCCL_LAT_NOTE),
            "scale_out_bw": _t(5e10, NV_DGX_H100, "DGX H100 SuperPOD: one 400 Gb/s ConnectX-7 NDR NIC per GPU = 5e10 "
                               "B/s one way (scaling book 'Beyond the node level' agrees). System-dependent."),
        },
        "host_link_bw": _t(6.4e10, NV_H100, NO_STORED_NV + "'PCIe Gen5: 128GB/s' (both directions) = 64 GB/s one way."),
        "matrix_unit": _t((64, 64), NV_MATMUL_GUIDE,
                          "As A100: multiples of 128 bytes (64 two-byte elements) keep cuBLAS tiles full; shape in "
                          "2-byte elements. Hopper WGMMA instructions are m64nNk16."),
        "transcendentals_per_s": _t(16 * 132 * 1.98e9, CUDA_GUIDE,
                                    SFU_NOTE + "x 132 SMs x 1.98 GHz max boost (scaling book clock table; consistent "
                                    "with 67 TFLOPS = 2 x 128 x 132 x 1.98e9) = 4.18e12 results/s."),
    },
    "h200": {
        "vendor": "NVIDIA", "kind": "gpu", "aliases": ["h200-sxm", "h200-141gb", "h200-sxm-141gb", "NVIDIA H200"],
        "peak_flops": {
            "float32": _t(6.7e13, NV_H200, NO_STORED_NV + "H200 SXM FP32 67 TFLOPS (same GH100 die as H100)."),
            "tf32": _t(4.945e14, NV_H200, NO_STORED_NV + "TF32 989 TFLOPS sparse -> 494.5 dense."),
            "bfloat16": _t(9.895e14, NV_H200, NO_STORED_NV + "BF16 1,979 TFLOPS sparse -> 989.5 dense. Measured on an "
                           "H200 SXM (driver 580, jax 0.11.2, 2026-12-04; `workbench calibrate`): 684 TFLOP/s at "
                           "8192^3 through XLA, fp8 919 (docs/gpu.md)."),
            "float16": _t(9.895e14, NV_H200, NO_STORED_NV + "FP16 1,979 sparse -> 989.5 dense."),
            "float8_e4m3fn": _t(1.979e15, NV_H200, NO_STORED_NV + "FP8 3,958 TFLOPS sparse -> 1,979 dense."),
            "float8_e5m2": _t(1.979e15, NV_H200, NO_STORED_NV + "Same FP8 rate for E5M2."),
            "int8": _t(1.979e15, NV_H200, NO_STORED_NV + "INT8 3,958 TOPS sparse -> 1,979 dense."),
        },
        "hbm_bytes": _t(141e9, NV_H200, NO_STORED_NV + "'141GB' HBM3e."),
        "hbm_bw": _t(4.8e12, NV_H200, NO_STORED_NV + "'4.8TB/s'. Measured here: 4.3 TB/s device copy (DESIGN.md)."),
        "onchip_bytes": _t(132 * 256 * 1024 + 50 * 2**20, SCALING_GPUS,
                           "SMEM+L2 as H100: 132 SMs x 256 kB + 50 MB L2 (scaling book)."),
        "interconnect": {
            "kind": "nvlink",
            "link_bw": _t(2.5e10, SCALING_GPUS, "NVLink 4.0, as H100: 25 GB/s each way per link (900 GB/s per GPU "
                          "bidirectional)."),
            "links": _t(18, SCALING_GPUS, "18 NVLink ports per GPU (Hopper)."),
            "latency_s": _t(3.4e-6, NCCL_TUNING, NCCL_LAT_NOTE),
            "scale_out_bw": _t(5e10, NV_DGX_H100, "DGX H200 / HGX H200 reference: one 400 Gb/s ConnectX-7 per GPU = "
                               "5e10 B/s one way. System-dependent."),
        },
        "host_link_bw": _t(6.4e10, NV_H200, NO_STORED_NV + "'PCIe Gen5: 128GB/s' (both directions) = 64 GB/s one way."),
        "matrix_unit": _t((64, 64), NV_MATMUL_GUIDE, "As H100 (2-byte elements)."),
        "transcendentals_per_s": _t(16 * 132 * 1.98e9, CUDA_GUIDE,
                                    SFU_NOTE + "x 132 SMs x 1.98 GHz (as H100) = 4.18e12 results/s."),
    },
    "b200": {
        "vendor": "NVIDIA", "kind": "gpu", "aliases": ["b200-sxm", "hgx-b200", "dgx-b200", "blackwell", "NVIDIA B200"],
        "peak_flops": {
            "float32": _t(7.5e13, NV_HGX, NO_STORED_NV + "HGX B200 per-GPU table: FP32 75 TFLOPS (GB200 variant: 80; "
                          "the scaling book quotes 80 from the Blackwell architecture page)."),
            "tf32": _t(1.1e15, NV_HGX, NO_STORED_NV + "TF32 Tensor Core 2.2 PFLOPS with sparsity -> 1.1 dense."),
            "bfloat16": _t(2.25e15, NV_HGX, NO_STORED_NV + "FP16/BF16 Tensor Core 4.5 PFLOPS with sparsity -> 2.25 "
                           "dense (scaling book: 2.3e15)."),
            "float16": _t(2.25e15, NV_HGX, NO_STORED_NV + "As bfloat16."),
            "float8_e4m3fn": _t(4.5e15, NV_HGX, NO_STORED_NV + "FP8/FP6 Tensor Core 9 PFLOPS sparse -> 4.5 dense "
                                "(DGX B200: 72 PFLOPS FP8 sparse for 8 GPUs agrees)."),
            "float8_e5m2": _t(4.5e15, NV_HGX, NO_STORED_NV + "Same FP8 rate for E5M2."),
            "int8": _t(4.5e15, NV_HGX, NO_STORED_NV + "INT8 Tensor Core 9 POPS sparse -> 4.5 dense."),
            "float4_e2m1fn": _t(9e15, NV_HGX, NO_STORED_NV + "FP4 Tensor Core 18 PFLOPS sparse -> 9 dense (DGX B200: "
                                "144 PF sparse / 72 PF dense for 8 GPUs)."),
        },
        "hbm_bytes": _t(180e9, NV_HGX, NO_STORED_NV + "HGX B200 per-GPU table: 180GB HBM3E; DGX B200: 1,440 GB total / "
                        "8. The launch figure (and DESIGN.md) is 192 GB."),
        "hbm_bw": _t(7.7e12, NV_HGX, NO_STORED_NV + "HGX B200 per-GPU table: 7.7TB/s. DGX B200 '64 TB/s' / 8 = 8.0e12 "
                     "and the launch figure / scaling book use 8.0e12."),
        "onchip_bytes": _t(148 * 256 * 1024 + 126 * 2**20, SCALING_GPUS,
                           "SMEM+L2: 148 SMs x 256 kB + 126 MB L2 (scaling book). The 256 kB/SM tensor memory "
                           "(TMEM) is not included."),
        "interconnect": {
            "kind": "nvlink",
            "link_bw": _t(5e10, SCALING_GPUS, "NVLink 5.0: 50 GB/s each way per link; NVIDIA: '5th Generation NVLink: "
                          "1.8TB/s' per GPU = 18 x 50 x 2."),
            "links": _t(18, SCALING_GPUS, "18 NVLink ports per GPU; 2 NVSwitch chips in an 8-GPU HGX/DGX B200."),
            "latency_s": _t(3.4e-6, NCCL_TUNING, NCCL_LAT_NOTE + " Not specific to NVLink 5."),
            "scale_out_bw": _t(5e10, NV_DGX_B200, "DGX B200: 8x single-port ConnectX-7 up to 400 Gb/s, one per GPU = "
                               "5e10 B/s one way (scaling book table: 400e9 node egress / 8). System-dependent."),
        },
        "host_link_bw": _t(6.4e10, NV_HGX, NO_STORED_NV + "HGX B200 table: 'PCIe Gen5: 128GB/s' (both directions) = "
                           "64 GB/s one way (some third-party pages say Gen6)."),
        "matrix_unit": _t((64, 64), NV_MATMUL_GUIDE, "Alignment rule carried over from Hopper (128 bytes, 2-byte "
                          "elements); Blackwell's tcgen05 MMA tiles are larger, so this is a lower bound."),
        "transcendentals_per_s": _t(16 * 148 * (7.5e13 / (2 * 128 * 148)), CUDA_GUIDE,
                                    SFU_NOTE + "The cc 10.0 column was NOT checked against a stored copy (assumed "
                                    "16 as for 9.0). x 148 SMs x 1.98 GHz, the clock implied by 75 TFLOPS FP32 = "
                                    "2 x 128 lanes x 148 SMs x f (NVIDIA does not print a B200 boost clock) "
                                    "= 4.69e12 results/s."),
    },
    # ------------------------------------------------------------------ AMD
    "mi300x": {
        "vendor": "AMD", "kind": "gpu", "aliases": ["mi300", "instinct-mi300x", "amd-mi300x", "AMD Instinct MI300X"],
        "peak_flops": {
            "float32": _t(1.634e14, AMD_MI300X, NO_STORED_AMD + "Peak FP32 vector 163.4 TFLOPs (matrix FP32 also "
                          "163.4). AMD also lists a TF32 matrix rate; no stored copy confirmed its value, so 'tf32' "
                          "is left out rather than guessed."),
            "bfloat16": _t(1.3074e15, AMD_MI300X, NO_STORED_AMD + "Peak BF16 1307.4 TFLOPs dense (2614.9 sparse)."),
            "float16": _t(1.3074e15, AMD_MI300X, NO_STORED_AMD + "Peak FP16 1307.4 TFLOPs dense."),
            "float8_e4m3fnuz": _t(2.6149e15, AMD_MI300X, NO_STORED_AMD + "Peak FP8 2614.9 TFLOPs dense (5229.8 "
                                  "sparse). CDNA3 FP8 is the FNUZ variant (jnp.float8_e4m3fnuz / e5m2fnuz); OCP "
                                  "float8_e4m3fn/e5m2 are not native on MI300X, so they are absent here."),
            "float8_e5m2fnuz": _t(2.6149e15, AMD_MI300X, NO_STORED_AMD + "Same FP8 rate for the E5M2 FNUZ format."),
            "int8": _t(2.6149e15, AMD_MI300X, NO_STORED_AMD + "Peak INT8 2614.9 TOPs dense."),
        },
        "hbm_bytes": _t(192e9, AMD_MI300X, NO_STORED_AMD + "'192 GB HBM3'."),
        "hbm_bw": _t(5.3e12, AMD_MI300X, NO_STORED_AMD + "'5.3 TB/s' peak memory bandwidth."),
        "onchip_bytes": _t(304 * 64 * 1024 + 32 * 2**20, ROCM_SPECS,
                           "LDS+L2: 304 CUs x 64 KiB LDS + 32 MiB L2 (4 MiB per XCD), ROCm GPU specs table (stored "
                           "copy shows the MI325X row, same CDNA3 die). The 256 MiB Infinity Cache (memory-side "
                           "last level) is not included."),
        "interconnect": {
            "kind": "infinity-fabric",
            "link_bw": _t(6.4e10, AMD_MI300X, NO_STORED_AMD + "'Peak Infinity Fabric Link Bandwidth 128 GB/s' is "
                          "bidirectional per link -> 64 GB/s one way (DESIGN.md: 6.4e10)."),
            "links": _t(7, AMD_MI300X, NO_STORED_AMD + "7 Infinity Fabric links: fully connected 8-GPU platform, one "
                        "link to each peer (so one peer gets 64 GB/s, not 7x)."),
            "latency_s": _t(3.4e-6, NCCL_TUNING, NCCL_LAT_NOTE + " RCCL is a fork of NCCL; its MI300X tuning was not "
                            "checked."),
            "scale_out_bw": _t(5e10, AZURE_ND_MI300X, "ND MI300X v5: 'Infiniband ... 8x400 Gigabit NDR' for 8 GPUs = "
                               "400 Gb/s per GPU = 5e10 B/s one way. System-dependent."),
        },
        "host_link_bw": _t(6.4e10, AMD_MI300X, NO_STORED_AMD + "PCIe Gen5 x16, 128 GB/s both directions = 64 GB/s "
                           "one way (MLPerf system descriptions: 'PCIe Gen5 x16')."),
        "matrix_unit": _t((16, 16), MODULAR_TC,
                          "AMD matrix-core (MFMA) half-precision shapes 16x16x16 and 32x32x8 as listed there; the "
                          "smaller tile is stored. No AMD padding guidance found in the stored copies."),
        "transcendentals_per_s": _t(None, ROCM_SPECS, "AMD publishes no transcendental (special-function) rate for "
                                    "MI300X in its datasheet or the ROCm specs table."),
    },
}

# ---------------------------------------------------------------------------------------------------------------
# The newest chips in the catalogue: TPU v7x (Ironwood), NVIDIA Blackwell Ultra (B300 in HGX, GB300 in the NVL72 rack),
# AMD MI355X. Read on READ_2026_12 against the stored copies named in each note.

READ_2026_12 = "2026-12-01"
CLOUD_TPU_7X = "https://docs.cloud.google.com/tpu/docs/tpu7x (TPU7x (Ironwood) system architecture table)"
CLOUD_TPU_7X_PERF = "https://docs.cloud.google.com/tpu/docs/ironwood-performance (TPU7x performance optimizations)"
JAX_TPU_INFO = ("jax 0.12.0.1 jax/_src/tpu_info.py, TpuInfo for ChipVersion.TPU_7X (per TensorCore figures; "
                "https://github.com/jax-ml/jax)")
NV_HGX_B300 = "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B300 technical specifications)"
NV_GB300 = "https://www.nvidia.com/en-us/data-center/gb300-nvl72/ (GB300 NVL72 specifications)"
NV_BLACKWELL_ULTRA_COPY = ("verda.com/blog/gb300-nvl72-architecture ('Per-GPU specifications', dense figures for "
                           "GB300/GB200/B300/B200 reproduced from NVIDIA's tables)")
AMD_MI355X = "https://www.amd.com/en/products/accelerators/instinct/mi350/mi355x.html"
AMD_CDNA4_ISSCC = ("AMD at ISSCC 2026 on MI355X (as reported by world-today-news.com, 2026-02): 32 CUs per XCD x 8 XCDs, "
                   "FP8 8,192 FLOPs/clock/CU, 'five petaflops' FP8")
MI355X_FP8 = 8192 * 256 * 2.4e9  # FLOPs/clock/CU x CUs x max clock (AMD_CDNA4_ISSCC); AMD rounds it to 5.0 PF
ROCM_SPECS_7 = "https://rocm.docs.amd.com/en/7.13.0-preview/reference/gpu-specs.html (MI355X row)"

NO_STORED_NV_BU = ("No stored copy of NVIDIA's own page was found; values checked against copies that reproduce its "
                   "tables (verda.com GB300 NVL72 architecture blog; glennklockwood.com/garden/processors/B300; "
                   "fibermall HGX B300 table). ")
NO_STORED_AMD_355 = ("No stored copy of AMD's product page was found; values checked against copies that reproduce "
                     "AMD's figures (theregister.com 2025-06-12, humeconsulting.co MI355X analysis, aiwiki MI355X) and "
                     "the ISSCC derivation below. ")
TPU7X_CORES_NOTE = ("Per chip. A TPU7x chip is two chiplets, each one TensorCore with its own HBM; libtpu has no "
                    "megacore config for it and exposes each TensorCore as its own JAX device (get_topology_desc("
                    "'tpu7x:2x2x1') gives 8 devices for 4 chips, two per chip coordinate). Per-device figures are "
                    "these / 2 (HardwareSpec.per_device; jax's tpu_info states them per TensorCore the same way).")

CHIPS.update({
    "tpu-v7x": {
        "vendor": "Google", "kind": "tpu", "aliases": ["v7x", "tpu7x", "7x", "ironwood", "tpu-ironwood", "tpu-v7", "TPU7x"],
        "tpu_generation": "v7x",
        "cores_per_chip": _t(2, CLOUD_TPU_7X, "'Each TPU7x chip contains two TensorCores and four SparseCores'; "
                             "table: 'Number of TensorCores per chip: 2'.", READ_2026_12),
        "peak_flops": {
            "bfloat16": _t(2.307e15, CLOUD_TPU_7X, "'Peak compute per chip (BF16) (TFLOPs): 2307' (DESIGN.md's ~2.3e15 "
                           "verified). jax's tpu_info: 2.31e15 per chip. " + TPU7X_CORES_NOTE, READ_2026_12),
            "float8_e4m3fn": _t(4.614e15, CLOUD_TPU_7X, "'Peak compute per chip (FP8) (TFLOPs): 4614'; native FP8 in "
                                "the MXU ('built-in hardware acceleration for FP8', " + CLOUD_TPU_7X_PERF + "). jax's "
                                "tpu_info lists E4M3FN and E5M2 as MXU operand types for TPU7x.", READ_2026_12),
            "float8_e5m2": _t(4.614e15, CLOUD_TPU_7X, "Same FP8 rate for E5M2 (the page gives one FP8 figure).",
                              READ_2026_12),
            "float32": _t(2.307e15 / 6, CLOUD_TPU_7X, TPU_F32_NOTE, READ_2026_12),
        },
        "hbm_bytes": _t(192 * 2**30, CLOUD_TPU_7X, "'HBM capacity per chip (GiB): 192' (launch material: '192 GB'; "
                        "jax's tpu_info: 206e9 bytes per chip = 192 GiB, split over the two TensorCores). "
                        + TPU7X_CORES_NOTE, READ_2026_12),
        "hbm_bw": _t(7.38e12, CLOUD_TPU_7X, "'HBM bandwidth per chip (GB/s): 7380' (launch material 7.37 TB/s; jax's "
                     "tpu_info 7.4e12).", READ_2026_12),
        "onchip_bytes": _t(2 * 64 * 2**20, JAX_TPU_INFO, "VMEM 64 MiB per TensorCore x 2 (tpu_info "
                           "vmem_capacity_bytes); Google's page publishes no VMEM size.", READ_2026_12),
        "interconnect": {
            "kind": "ici-torus-3d",
            "link_bw": _t(1e11, CLOUD_TPU_7X, "'Bidirectional inter-chip interconnect (ICI) bandwidth per chip (GB/s): "
                          "1200' over 6 torus links = 200 GB/s bidirectional = 100 GB/s one way per link (the same "
                          "derivation as v5p, whose page prints the same 1200). Google prints only the per-chip total.",
                          READ_2026_12),
            "links": _t(6, CLOUD_TPU_7X, "3D torus (64-chip 4x4x4 cubes joined by optical circuit switches, like v4/"
                        "v5p): 6 nearest neighbours. The link count per chip is not printed on the page; 6 is what a "
                        "3D torus needs. The two TensorCores of a chip share these links; jax's mesh_utils treats the "
                        "in-chip 'core' axis as the highest-bandwidth one (die-to-die, not modelled separately).",
                        READ_2026_12),
            "latency_s": _t(1e-6, SCALING_TPUS, TPU_LATENCY_NOTE, READ_2026_12),
            "scale_out_bw": _t(1.25e10, CLOUD_TPU_7X, "'Data center network (DCN) bandwidth per chip (Gb/s): 100' = "
                               "1.25e10 B/s.", READ_2026_12),
        },
        "host_link_bw": _t(None, CLOUD_TPU_7X, "Not published for TPU7x.", READ_2026_12),
        "matrix_unit": _t((256, 256), JAX_TPU_INFO, "mxu_column_size 256 (256x256 systolic MXUs, as v6e).",
                          READ_2026_12),
        "transcendentals_per_s": _t(None, CLOUD_TPU_7X, "Not published for any TPU.", READ_2026_12),
        "notes": ["int8 is absent: jax's tpu_info gives int8_ops_per_second=0 ('Not Available') for TPU7x and Google "
                  "prints no int8 figure; int8 matmuls are priced at the bf16 rate.",
                  "Two TensorCores per chip, one JAX device each: a tpu-v7x:XxYxZ target has 2*X*Y*Z devices; "
                  "predictions are per device against HardwareSpec.per_device(2) (half of every per-chip figure)."],
    },
    # ------------------------------------------------------------------ NVIDIA Blackwell Ultra
    "b300": {
        "vendor": "NVIDIA", "kind": "gpu", "aliases": ["b300-sxm", "hgx-b300", "dgx-b300", "blackwell-ultra"],
        "peak_flops": {
            "float32": _t(7.5e13, NV_HGX_B300, NO_STORED_NV_BU + "HGX B300: FP32 600 TFLOPS for 8 GPUs = 75 per GPU "
                          "(CUDA cores; vendor figure is dense).", READ_2026_12),
            "tf32": _t(1.125e15, NV_HGX_B300, NO_STORED_NV_BU + "TF32 Tensor Core 18 PFLOPS with sparsity for 8 GPUs "
                       "-> 2.25 sparse -> 1.125 dense per GPU (verda: 1.1). SPARSE-ONLY in the vendor table.",
                       READ_2026_12),
            "bfloat16": _t(2.25e15, NV_HGX_B300, NO_STORED_NV_BU + "FP16/BF16 Tensor Core 36 PFLOPS with sparsity for "
                           "8 GPUs -> 4.5 sparse -> 2.25 dense per GPU (verda: 2.25). SPARSE-ONLY in the vendor "
                           "table.", READ_2026_12),
            "float16": _t(2.25e15, NV_HGX_B300, NO_STORED_NV_BU + "As bfloat16 (sparse-only in the vendor table).",
                          READ_2026_12),
            "float8_e4m3fn": _t(4.5e15, NV_HGX_B300, NO_STORED_NV_BU + "FP8/FP6 Tensor Core 72 PFLOPS with sparsity "
                                "for 8 GPUs -> 9 sparse -> 4.5 dense per GPU (verda: 4.5). SPARSE-ONLY in the "
                                "vendor table.", READ_2026_12),
            "float8_e5m2": _t(4.5e15, NV_HGX_B300, NO_STORED_NV_BU + "Same FP8 rate for E5M2.", READ_2026_12),
            "float6_e2m3fn": _t(4.5e15, NV_HGX_B300, NO_STORED_NV_BU + "FP6 shares the FP8 row ('FP8/FP6 Tensor "
                                "Core'): 4.5 dense per GPU; sparse-only in the vendor table.", READ_2026_12),
            "float6_e3m2fn": _t(4.5e15, NV_HGX_B300, NO_STORED_NV_BU + "As float6_e2m3fn.", READ_2026_12),
            "float4_e2m1fn": _t(1.35e16, NV_HGX_B300, NO_STORED_NV_BU + "FP4 Tensor Core '144 PFLOPS | 108 PFLOPS' "
                                "(sparse | dense) for 8 GPUs -> 13.5 dense per GPU. NVIDIA prints FP4 both ways; "
                                "verda's per-GPU table rounds to 14, glennklockwood's copy has 13.1.", READ_2026_12),
            "int8": _t(1.5e14, NV_BLACKWELL_ULTRA_COPY, "Blackwell Ultra cut the INT8 tensor rate: verda's per-GPU "
                       "table gives B300 INT8 0.15 POPS dense (GB300 0.165; B200 4.5). The HGX table prints INT8 "
                       "sparse-only (fibermall copy: '2 POPS' for the platform). Low confidence: no NVIDIA page "
                       "copy.", READ_2026_12),
        },
        "hbm_bytes": _t(270e9, NV_BLACKWELL_ULTRA_COPY, "B300 in HGX: 270 GB HBM3E per GPU usable (verda table; "
                        "HGX B300 'up to 2.1 TB' for 8). The package carries 288 GB (8 x 12-high stacks; DGX B300 "
                        "2.3 TB = 8 x 288); 270 is what the HGX table states per GPU.", READ_2026_12),
        "hbm_bw": _t(7.7e12, NV_BLACKWELL_ULTRA_COPY, "7.7 TB/s per GPU in HGX B300 (verda table); 'up to 8 TB/s' "
                     "for GB300 and in launch material.", READ_2026_12),
        "onchip_bytes": _t(None, NV_HGX_B300, "NVIDIA publishes no L2 or shared-memory totals for B300.",
                           READ_2026_12),
        "interconnect": {
            "kind": "nvlink",
            "link_bw": _t(5e10, NV_HGX_B300, NO_STORED_NV_BU + "Fifth-generation NVLink, 'NVSwitch GPU-to-GPU "
                          "bandwidth 1.8 TB/s' per GPU (bidirectional) = 18 links x 50 GB/s one way; total NVLink "
                          "14.4 TB/s for 8 GPUs.", READ_2026_12),
            "links": _t(18, NV_HGX_B300, "18 NVLink 5 links per GPU (as B200).", READ_2026_12),
            "latency_s": _t(3.4e-6, NCCL_TUNING, NCCL_LAT_NOTE + " Not specific to NVLink 5.", READ_2026_12),
            "scale_out_bw": _t(1e11, NV_HGX_B300, NO_STORED_NV_BU + "ConnectX-8 SuperNIC, 800 Gb/s per GPU "
                               "('networking bandwidth 1.6 TB/s' for 8 GPUs, bidirectional) = 1e11 B/s one way. "
                               "System-dependent.", READ_2026_12),
        },
        "host_link_bw": _t(1.28e11, NV_HGX_B300, NO_STORED_NV_BU + "PCIe Gen6 x16 (glennklockwood copy: 'upgrade to "
                           "PCIe Gen6'): 128 GB/s one way.", READ_2026_12),
        "matrix_unit": _t((64, 64), NV_MATMUL_GUIDE, "Alignment rule carried over from Hopper (128 bytes, 2-byte "
                          "elements), as b200: a lower bound for tcgen05 tiles.", READ_2026_12),
        "transcendentals_per_s": _t(1.07e13, NV_BLACKWELL_ULTRA_COPY, "'Attention acceleration (SFU EX2) 10.7 "
                                    "TeraExponentials/s' for B300 and GB300 (B200: 5): Blackwell Ultra doubled the "
                                    "SFU exp2 rate. exp2 only; other special functions not stated.", READ_2026_12),
        "notes": ["SPARSE-ONLY in NVIDIA's table: TF32, FP16/BF16, FP8/FP6 and INT8 tensor figures carry the "
                  "'with sparsity' footnote and are halved here; FP4 is printed both sparse and dense; FP32 is dense."],
    },
    "gb300": {
        "vendor": "NVIDIA", "kind": "gpu", "aliases": ["gb300-nvl72", "b300-nvl72", "grace-blackwell-ultra"],
        "peak_flops": {
            "float32": _t(8.0e13, NV_GB300, NO_STORED_NV_BU + "GB300 NVL72 per GPU: FP32 80 TFLOPS (verda; the rack's "
                          "6 PFLOPS over 72 = 83; the higher power envelope of the NVL72 rack).", READ_2026_12),
            "tf32": _t(1.25e15, NV_GB300, NO_STORED_NV_BU + "TF32 Tensor Core 180 PFLOPS sparse for 72 GPUs -> 2.5 "
                       "sparse -> 1.25 dense per GPU (verda: 1.25). SPARSE-ONLY in the vendor table.", READ_2026_12),
            "bfloat16": _t(2.5e15, NV_GB300, NO_STORED_NV_BU + "FP16/BF16 Tensor Core 360 PFLOPS sparse for 72 GPUs "
                           "-> 5 sparse -> 2.5 dense per GPU (verda rack aggregate: 180 dense). SPARSE-ONLY in the "
                           "vendor table.", READ_2026_12),
            "float16": _t(2.5e15, NV_GB300, NO_STORED_NV_BU + "As bfloat16.", READ_2026_12),
            "float8_e4m3fn": _t(5e15, NV_GB300, NO_STORED_NV_BU + "FP8/FP6 Tensor Core 720 PFLOPS sparse for 72 GPUs "
                                "-> 10 sparse -> 5 dense per GPU (rack: '360 PF FP8 for training', dense). "
                                "SPARSE-ONLY in the vendor table.", READ_2026_12),
            "float8_e5m2": _t(5e15, NV_GB300, NO_STORED_NV_BU + "Same FP8 rate for E5M2.", READ_2026_12),
            "float6_e2m3fn": _t(5e15, NV_GB300, NO_STORED_NV_BU + "FP6 shares the FP8 row.", READ_2026_12),
            "float6_e3m2fn": _t(5e15, NV_GB300, NO_STORED_NV_BU + "As float6_e2m3fn.", READ_2026_12),
            "float4_e2m1fn": _t(1.5e16, NV_GB300, NO_STORED_NV_BU + "FP4 Tensor Core '1,440 | 1,080 PFLOPS' (sparse | "
                                "dense) for 72 GPUs -> 15 dense per GPU (verda: 15; '1.1 EF dense FP4').",
                                READ_2026_12),
            "int8": _t(1.65e14, NV_BLACKWELL_ULTRA_COPY, "INT8 0.165 POPS dense per GPU (verda); the rack table prints "
                       "INT8 sparse only (23-24 POPS for 72). Low confidence: no NVIDIA page copy.", READ_2026_12),
        },
        "hbm_bytes": _t(279e9, NV_BLACKWELL_ULTRA_COPY, "279 GB HBM3E per GPU usable (verda table; rack 'up to 20 TB' "
                        "/ 72 = 278-288 depending on the revision; the package carries 288 GB).", READ_2026_12),
        "hbm_bw": _t(8e12, NV_GB300, NO_STORED_NV_BU + "Rack 576 TB/s / 72 = 8 TB/s per GPU (verda: 8).",
                     READ_2026_12),
        "onchip_bytes": _t(None, NV_GB300, "NVIDIA publishes no L2 or shared-memory totals for Blackwell Ultra.",
                           READ_2026_12),
        "interconnect": {
            "kind": "nvlink",
            "link_bw": _t(5e10, NV_GB300, NO_STORED_NV_BU + "NVLink 5: rack 130 TB/s / 72 = 1.8 TB/s per GPU "
                          "(bidirectional) = 18 x 50 GB/s one way. One NVLink domain spans all 72 GPUs (the "
                          "collective model's 8-GPU node boundary does not apply; GB300 is not a prediction target).",
                          READ_2026_12),
            "links": _t(18, NV_GB300, "18 NVLink 5 links per GPU.", READ_2026_12),
            "latency_s": _t(3.4e-6, NCCL_TUNING, NCCL_LAT_NOTE + " Not specific to NVLink 5.", READ_2026_12),
            "scale_out_bw": _t(1e11, NV_GB300, NO_STORED_NV_BU + "72 ConnectX-8 SuperNICs, 800 Gb/s per GPU = 1e11 "
                               "B/s one way.", READ_2026_12),
        },
        "host_link_bw": _t(None, NV_GB300, "The GPU reaches its Grace CPU over NVLink-C2C, not PCIe; no per-GPU "
                           "one-way figure stored here.", READ_2026_12),
        "matrix_unit": _t((64, 64), NV_MATMUL_GUIDE, "As b300.", READ_2026_12),
        "transcendentals_per_s": _t(1.07e13, NV_BLACKWELL_ULTRA_COPY, "SFU EX2 10.7 TeraExponentials/s (as B300).",
                                    READ_2026_12),
        "notes": ["SPARSE-ONLY in NVIDIA's GB300 NVL72 table: TF32, FP16/BF16, FP8/FP6, INT8 (halved here); FP4 "
                  "printed sparse and dense; FP32 dense. Per-GPU figures are the rack's / 72."],
    },
    # ------------------------------------------------------------------ AMD CDNA4
    "mi355x": {
        "vendor": "AMD", "kind": "gpu", "aliases": ["mi355", "instinct-mi355x", "amd-mi355x", "AMD Instinct MI355X"],
        "peak_flops": {
            "float32": _t(1.573e14, AMD_MI355X, NO_STORED_AMD_355 + "Peak FP32 vector 157.3 TFLOPs (dense).",
                          READ_2026_12),
            "bfloat16": _t(2.5e15, AMD_MI355X, NO_STORED_AMD_355 + "Peak BF16 matrix 2.5 PFLOPs dense (5.0 with "
                           "sparsity), AMD's figure (half the FP8 rate below, which the ISSCC clock arithmetic puts "
                           "at 5.03e15).", READ_2026_12),
            "float16": _t(2.5e15, AMD_MI355X, NO_STORED_AMD_355 + "As bfloat16.", READ_2026_12),
            "float8_e4m3fn": _t(MI355X_FP8, AMD_CDNA4_ISSCC, NO_STORED_AMD_355 + "8,192 FLOPs/clock/CU x 256 CUs x "
                                "2.4 GHz (MI355X max clock) = 5.03e15 dense ('five petaflops'; AMD: 5.0 PF dense, "
                                "10.1 with sparsity). CDNA4 FP8 is OCP E4M3FN/E5M2 (CDNA3's FNUZ formats were "
                                "replaced).", READ_2026_12),
            "float8_e5m2": _t(MI355X_FP8, AMD_CDNA4_ISSCC, "Same FP8 rate for E5M2.", READ_2026_12),
            "float6_e2m3fn": _t(2 * MI355X_FP8, AMD_MI355X, NO_STORED_AMD_355 + "MXFP6 runs at the MXFP4 rate on CDNA4: "
                                "10.1 PF dense (theregister: 'up to 10 petaFLOPS' FP4/FP6). Unlike NVIDIA, AMD "
                                "prices FP6 like FP4, not like FP8.", READ_2026_12),
            "float6_e3m2fn": _t(2 * MI355X_FP8, AMD_MI355X, NO_STORED_AMD_355 + "As float6_e2m3fn.", READ_2026_12),
            "float4_e2m1fn": _t(2 * MI355X_FP8, AMD_MI355X, NO_STORED_AMD_355 + "MXFP4 10.1 PF dense (2x FP8). AMD "
                                "publishes no sparse FP4/FP6 figure.", READ_2026_12),
            "int8": _t(MI355X_FP8, AMD_MI355X, NO_STORED_AMD_355 + "Peak INT8 5.0 POPs dense (10.1 sparse).",
                       READ_2026_12),
        },
        "hbm_bytes": _t(288e9, AMD_MI355X, NO_STORED_AMD_355 + "'288 GB HBM3E' (ROCm specs table prints 288 as GiB; "
                        "AMD's page says GB).", READ_2026_12),
        "hbm_bw": _t(8e12, AMD_MI355X, NO_STORED_AMD_355 + "'8 TB/s' peak memory bandwidth.", READ_2026_12),
        "onchip_bytes": _t(256 * 160 * 1024 + 32 * 2**20, ROCM_SPECS_7,
                           "LDS+L2: 256 CUs x 160 KiB LDS + 32 MiB L2 (4 MiB per XCD). The 256 MiB Infinity Cache "
                           "(memory-side last level) is not included.", READ_2026_12),
        "interconnect": {
            "kind": "infinity-fabric",
            "link_bw": _t(7.68e10, AMD_MI355X, NO_STORED_AMD_355 + "Infinity Fabric (xGMI) link 153.6 GB/s "
                          "bidirectional (humeconsulting: '~153 GB/s') -> 76.8 GB/s one way.", READ_2026_12),
            "links": _t(7, AMD_MI355X, NO_STORED_AMD_355 + "7 links: fully connected 8-GPU UBB platform, one link per "
                        "peer (as MI300X).", READ_2026_12),
            "latency_s": _t(3.4e-6, NCCL_TUNING, NCCL_LAT_NOTE + " RCCL's MI355X tuning was not checked.",
                            READ_2026_12),
            "scale_out_bw": _t(5e10, AMD_MI355X, NO_STORED_AMD_355 + "400 Gb/s NIC per GPU (Pollara 400 in AMD's "
                               "reference platform) = 5e10 B/s one way. System-dependent.", READ_2026_12),
        },
        "host_link_bw": _t(6.4e10, AMD_MI355X, NO_STORED_AMD_355 + "PCIe Gen5 x16, 128 GB/s both directions = 64 GB/s "
                           "one way.", READ_2026_12),
        "matrix_unit": _t((16, 16), MODULAR_TC, "Smallest MFMA half-precision tile (16x16xK), as MI300X; CDNA4 "
                          "doubles K per instruction.", READ_2026_12),
        "transcendentals_per_s": _t(None, ROCM_SPECS_7, "AMD publishes no special-function rate for MI355X.",
                                    READ_2026_12),
        "notes": ["AMD prints dense figures with sparse ones beside them (no figure is sparse-only); FP6 runs at "
                  "the FP4 rate on CDNA4."],
    },
})
