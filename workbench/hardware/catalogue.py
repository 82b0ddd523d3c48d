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
        "vendor": "Google", "kind": "tpu", "aliases": ["v4", "tpuv4", "v4p", "tpu-v4p"],
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
        "vendor": "Google", "kind": "tpu", "aliases": ["v5e", "v5litepod", "v5lite", "tpu-v5-lite", "tpu-v5litepod"],
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
        "vendor": "Google", "kind": "tpu", "aliases": ["v5p", "tpu-v5"], "tpu_generation": "v5p",
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
        "vendor": "Google", "kind": "tpu", "aliases": ["v6e", "trillium", "tpu-trillium", "v6"],
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
        "vendor": "NVIDIA", "kind": "gpu", "aliases": ["a100", "a100-sxm", "a100-sxm4-80gb", "a100-80gb-sxm"],
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
        "vendor": "NVIDIA", "kind": "gpu", "aliases": ["h100", "h100-sxm5", "h100-80gb", "h100-sxm5-80gb"],
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
        "vendor": "NVIDIA", "kind": "gpu", "aliases": ["h200-sxm", "h200-141gb", "h200-sxm-141gb"],
        "peak_flops": {
            "float32": _t(6.7e13, NV_H200, NO_STORED_NV + "H200 SXM FP32 67 TFLOPS (same GH100 die as H100)."),
            "tf32": _t(4.945e14, NV_H200, NO_STORED_NV + "TF32 989 TFLOPS sparse -> 494.5 dense."),
            "bfloat16": _t(9.895e14, NV_H200, NO_STORED_NV + "BF16 1,979 TFLOPS sparse -> 989.5 dense. Measured on one "
                           "H200 lent to this project: 790 TFLOP/s (8192^3 bf16 matmul; DESIGN.md)."),
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
        "vendor": "NVIDIA", "kind": "gpu", "aliases": ["b200-sxm", "hgx-b200", "dgx-b200", "blackwell"],
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
        "vendor": "AMD", "kind": "gpu", "aliases": ["mi300", "instinct-mi300x", "amd-mi300x"],
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
