"""Tile model per chip: the shapes a matrix unit works on, how arrays are tiled in memory, and the on-chip memories a
kernel's blocks must fit in. Pure data + arithmetic (no JAX import); every figure carries its source and the date it
was read.

Keys are the hardware catalogue's chip names (workbench.hardware.catalogue / `workbench hw list`), plus chips another part
of the catalogue adds (tpu-v7x, b300, mi355x); `tile_model(name)` also accepts the catalogue's short aliases.

Conventions:
  * TPU figures are per TensorCore (a v4/v5p chip has two, fused into one JAX device in megacore mode; v7x has two
    that are separate devices). `matrix_unit` is the systolic array (rows, cols); `matrix_units` the count per core.
  * `native_tiles[bits]` is the (sublanes, lanes) block one vector register holds for an element of that width:
    8 x 128 32-bit words, so (8,128) float32, (16,128) bfloat16 (two packed per word), (32,128) 8-bit. In HBM the
    TPU compiler writes this as the layout tile `T(8,128)(2,1)` for bfloat16 (an (8,128) tile of packed pairs).
  * GPU `mma_shapes[dtype]` is the (m, n, k) of the tensor-core instruction the compilers use on that chip
    (mma.sync on sm80, wgmma on sm90, tcgen05.mma on sm100; MFMA on CDNA). n is the smallest legal n where the
    instruction family lets n vary (wgmma: n = 8..256 in steps of 8).
  * `pad_granule(model, dtype)` is what a matmul dimension is rounded up to before the matrix unit sees it:
      TPU: m -> the sublane tile of the dtype (rows stream through the array), k and n -> the systolic array's side
           (the array is loaded k x n at a time: 128 on v4/v5e/v5p, 256 on v6e/v7x);
      GPU: the MMA instruction's (m, n, k).
    Libraries add their own block quantization on top (cuBLAS thread-block tiles, XLA's choice of tile per dot);
    this model is the hardware floor, and `workbench tiling sweep` reads what a compiler actually did.
"""
from __future__ import annotations

import dataclasses
import math

from workbench.errors import WorkbenchError
from workbench.hardware.spec import DTYPE_ALIASES, resolve_name

READ = "2026-12-01"

# ---- sources ----
JAX_TPU_INFO = ("jax-ml/jax jax/_src/pallas/mosaic/tpu_info.py (get_tpu_info: lanes, sublanes, MXU column size, "
                "MXUs, VMEM/SMEM per TensorCore); rendered as https://docs.jax.dev/en/latest/pallas/tpu/hardware.html")
JAX_PALLAS_TPU = ("https://docs.jax.dev/en/latest/pallas/tpu/pipelining.html (TPU memory spaces: VMEM, SMEM, "
                  "vector registers of 8 sublanes x 128 lanes) and "
                  "https://docs.jax.dev/en/latest/pallas/tpu/details.html (block shapes: last two dimensions "
                  "divisible by 8 and 128)")
JAX_SUBLANE_TILING = ("jax-ml/jax jax/_src/pallas/mosaic/tpu_info.py TpuInfo.get_sublane_tiling: 16- and 32-bit "
                      "types use 8 sublanes before TPU7x (bf16 packed two per 32-bit word); narrower types a "
                      "larger second-minor tile")
CLOUD_TPU_V5E = "https://cloud.google.com/tpu/docs/v5e"
CLOUD_TPU_V6E = "https://cloud.google.com/tpu/docs/v6e"
CLOUD_TPU_V5P = "https://cloud.google.com/tpu/docs/v5p"
CLOUD_TPU_V4 = "https://cloud.google.com/tpu/docs/v4"
PTX_MMA = ("NVIDIA PTX ISA, 'Warp-level matrix multiply-accumulate instructions' (mma.sync shapes m16n8k16 bf16/f16, "
           "m16n8k8 tf32, m16n8k32 s8/e4m3), https://docs.nvidia.com/cuda/parallel-thread-execution/ ; read in the "
           "copy of the PTX 9.0 spec text that the ptx-90-parser crate reproduces (docs.rs/ptx-90-parser)")
PTX_WGMMA = ("NVIDIA PTX ISA, 'Asynchronous warpgroup level matrix multiply-accumulate' (wgmma.mma_async shapes "
             "m64nNk16 f16/bf16, m64nNk8 tf32, m64nNk32 e4m3/e5m2/s8; N = 8..256 step 8), "
             "https://docs.nvidia.com/cuda/parallel-thread-execution/ ; read in the ptx-90-parser reproduction")
PTX_TCGEN05 = ("NVIDIA PTX ISA, 'TensorCore 5th Generation Family Instructions' (tcgen05.mma: M = 64 or 128 per "
               "CTA, 256 across a CTA pair; K = 16 for f16/bf16, 32 for f8; N up to 256 step 8/16), "
               "https://docs.nvidia.com/cuda/parallel-thread-execution/ (as known; no stored copy re-read)")
CUDA_SPECS = ("CUDA C++ Programming Guide, 'Technical Specifications per Compute Capability' (shared memory per SM: "
              "164 KB on 8.0, 228 KB on 9.0 and 10.0; 64 K 32-bit registers per SM), "
              "https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#features-and-technical-specifications"
              )
NV_MATMUL_GUIDE = ("NVIDIA Matrix Multiplication Background User's Guide, 'Tensor Core Requirements' and 'Tile "
                   "quantization', https://docs.nvidia.com/deeplearning/performance/"
                   "dl-performance-matrix-multiplication/index.html")
AMD_CK_XDLOPS = ("ROCm composable_kernel include/ck/utility/amd_xdlops.hpp (MFMA intrinsics per gfx: "
                 "__builtin_amdgcn_mfma_f32_32x32x8bf16_1k / 16x16x16bf16_1k on gfx94x; fp8 16x16x32, 32x32x16), "
                 "https://rocm.docs.amd.com/projects/composable_kernel/en/develop/doxygen/html/"
                 "amd__xdlops_8hpp_source.html")
ROCM_SPECS = ("https://rocm.docs.amd.com/en/latest/reference/gpu-specs.html (LDS per CU, VGPR file per CU, CUs)")
CDNA4_TLX = ("https://facebookexperimental.github.io/triton/website/tlx-gfx950.html (MI350X/MI355X: 256 CUs, "
             "160 KB LDS per CU, CDNA4 MFMA)")
CDNA4_ISA = ("AMD Instinct CDNA4 ISA reference guide (gfx950 MFMA: v_mfma_f32_16x16x32_bf16, 32x32x16_bf16; "
             "f8 16x16x128, 32x32x64), https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/"
             "instruction-set-architectures/amd-instinct-cdna4-instruction-set-architecture.pdf (as known; no "
             "stored copy re-read)")


@dataclasses.dataclass(frozen=True)
class Fact:
    """One figure and where it comes from."""

    value: object
    source: str
    date: str = READ
    note: str = ""

    def to_record(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TileModel:
    """How one chip tiles work (per core: TPU TensorCore, GPU SM/CU)."""

    chip: str
    kind: str                                    # tpu | gpu
    matrix_unit: Fact                            # TPU: systolic array (rows, cols); GPU: MMA of bf16 (m, n, k)
    matrix_units: Fact                           # per core (TPU MXUs per TensorCore; GPU tensor cores per SM)
    cores: Fact                                  # TensorCores per chip (TPU) / SMs or CUs per chip (GPU)
    native_tiles: dict[int, tuple[int, int]]     # element bits -> (sublanes, lanes) (TPU); {} on GPU
    mma_shapes: dict[str, tuple[int, int, int]]  # dtype -> (m, n, k) instruction shape (GPU); {} on TPU
    vector_register: Fact                        # TPU: one vreg (sublanes, lanes, bits); GPU: register file/SM bytes
    onchip_bytes: Fact                           # TPU: VMEM per TensorCore; GPU: shared memory (LDS) per SM/CU
    scalar_bytes: Fact | None = None             # TPU: SMEM per TensorCore
    default_scoped_vmem: Fact | None = None      # TPU: what Mosaic lets one kernel use without vmem_limit_bytes
    l2_bytes: Fact | None = None                 # NVIDIA GPU: L2 cache per chip
    clock_hz: Fact | None = None                 # NVIDIA GPU: boost clock
    compute_capability: Fact | None = None       # NVIDIA GPU: (major, minor)
    sources: dict[str, Fact] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_record(self) -> dict:
        d = dataclasses.asdict(self)
        d["native_tiles"] = {str(k): list(v) for k, v in self.native_tiles.items()}
        d["mma_shapes"] = {k: list(v) for k, v in self.mma_shapes.items()}
        return d


# ------------------------------------------------------------------------------------------------ TPU entries

_TPU_TILES = {32: (8, 128), 16: (16, 128), 8: (32, 128), 4: (64, 128)}
_TPU_TILES_NOTE = ("one vector register holds 8 sublanes x 128 lanes of 32-bit words; narrower types pack into a "
                   "word (bf16: 2, 8-bit: 4), so its native block is (8*32/bits, 128)")
_MIB = 2**20


def _tpu(chip: str, array: int, mxus: int, cores: int, vmem_mib: int, page: str, *, cores_note: str = "",
         scoped_mib: int | None = None, scoped_note: str = "") -> TileModel:
    vmem_note = f"{vmem_mib} MiB per TensorCore"
    return TileModel(
        chip=chip, kind="tpu",
        matrix_unit=Fact((array, array), JAX_TPU_INFO,
                         note=f"mxu_column_size {array}: a {array}x{array} systolic array; also {page}"),
        matrix_units=Fact(mxus, JAX_TPU_INFO, note=f"num_mxus {mxus} per TensorCore; also {page}"),
        cores=Fact(cores, page, note=cores_note or f"{cores} TensorCore(s) per chip"),
        native_tiles=dict(_TPU_TILES), mma_shapes={},
        vector_register=Fact((8, 128, 32), JAX_PALLAS_TPU, note="8 sublanes x 128 lanes x 32 bits = 4 KiB per vreg"),
        onchip_bytes=Fact(vmem_mib * _MIB, JAX_TPU_INFO, note="VMEM (vmem_capacity_bytes): " + vmem_note),
        scalar_bytes=Fact(1 * _MIB, JAX_TPU_INFO, note="SMEM (smem_capacity_bytes): 1 MiB per TensorCore"),
        default_scoped_vmem=(Fact(scoped_mib * _MIB, JAX_PALLAS_TPU, note=scoped_note) if scoped_mib else None),
        sources={"native_tiles": Fact(dict(_TPU_TILES), JAX_SUBLANE_TILING, note=_TPU_TILES_NOTE)},
    )


_SCOPED_NOTE = ("Mosaic's default scoped-VMEM limit for one kernel (raise it with CompilerParams(vmem_limit_bytes)); "
                "16 MiB before v6e, 32 MiB from v6e, as the Pallas TPU docs state it (as known, not re-read)")

TILES: dict[str, TileModel] = {
    "tpu-v4": _tpu("tpu-v4", 128, 4, 2, 16, CLOUD_TPU_V4, cores_note="2 TensorCores per chip (megacore: one device)",
                   scoped_mib=16, scoped_note=_SCOPED_NOTE),
    "tpu-v5e": _tpu("tpu-v5e", 128, 4, 1, 128, CLOUD_TPU_V5E, scoped_mib=16,
                    scoped_note=_SCOPED_NOTE + "; for v5e confirmed by libtpu compiling a Pallas kernel from a CPU "
                    "host: 'Scoped allocation with size 18.36M and limit 16.00M exceeded scoped vmem limit'"),
    "tpu-v5p": _tpu("tpu-v5p", 128, 4, 2, 64, CLOUD_TPU_V5P, cores_note="2 TensorCores per chip (megacore: one device)",
                    scoped_mib=16, scoped_note=_SCOPED_NOTE),
    "tpu-v6e": _tpu("tpu-v6e", 256, 2, 1, 128, CLOUD_TPU_V6E, scoped_mib=32, scoped_note=_SCOPED_NOTE),
    "tpu-v7x": _tpu("tpu-v7x", 256, 2, 2, 64, JAX_TPU_INFO,
                    cores_note="2 TensorCores per chip, each its own JAX device (no megacore)",
                    scoped_mib=32, scoped_note=_SCOPED_NOTE),
}
TILES["tpu-v7x"] = dataclasses.replace(
    TILES["tpu-v7x"], notes=("XLA uses the large second-minor tile for 16-bit types by default from TPU7x "
                             "(get_sublane_tiling): bf16 arrays tile (16,128) in HBM too",))

# ------------------------------------------------------------------------------------------------ GPU entries

_SM80_MMA = {"bfloat16": (16, 8, 16), "float16": (16, 8, 16), "tf32": (16, 8, 8), "float32": (16, 8, 8),
             "int8": (16, 8, 32)}
_SM90_MMA = {"bfloat16": (64, 8, 16), "float16": (64, 8, 16), "tf32": (64, 8, 8), "float32": (64, 8, 8),
             "int8": (64, 8, 32), "float8_e4m3fn": (64, 8, 32), "float8_e5m2": (64, 8, 32)}
_SM100_MMA = {"bfloat16": (128, 8, 16), "float16": (128, 8, 16), "tf32": (128, 8, 8), "float32": (128, 8, 8),
              "int8": (128, 8, 32), "float8_e4m3fn": (128, 8, 32), "float8_e5m2": (128, 8, 32),
              "float4_e2m1fn": (128, 8, 64)}
_CDNA3_MFMA = {"bfloat16": (32, 32, 8), "float16": (32, 32, 8), "float32": (32, 32, 2), "int8": (32, 32, 16),
               "float8_e4m3fnuz": (32, 32, 16), "float8_e5m2fnuz": (32, 32, 16)}
_CDNA4_MFMA = {"bfloat16": (32, 32, 16), "float16": (32, 32, 16), "float32": (32, 32, 2), "int8": (32, 32, 32),
               "float8_e4m3fn": (32, 32, 64), "float8_e5m2": (32, 32, 64), "float4_e2m1fn": (32, 32, 64)}
_KIB = 1024


def _gpu(chip: str, mma: dict, mma_src: str, mma_note: str, tcs: int, sms: int, sms_src: str, smem: int,
         smem_src: str, smem_note: str, regs: int, regs_src: str, regs_note: str, notes=(), *,
         die: tuple | None = None) -> TileModel:
    """A GPU's tile model; `die` = (L2 bytes, boost clock Hz, compute capability, source, note) where known (the
    facts a deviceless XLA:GPU compile reads, partitioning.topology.gpu_target_config)."""
    l2 = clock = cc = None
    if die:
        l2_b, hz, cap, src, note = die
        l2, clock, cc = Fact(l2_b, src, note=note), Fact(hz, src, note=note), Fact(cap, CUDA_SPECS)
    return TileModel(
        chip=chip, kind="gpu",
        matrix_unit=Fact(mma["bfloat16"], mma_src, note=mma_note),
        matrix_units=Fact(tcs, sms_src, note=f"{tcs} tensor/matrix cores per SM/CU"),
        cores=Fact(sms, sms_src, note=f"{sms} SMs/CUs per GPU"),
        native_tiles={}, mma_shapes=dict(mma),
        vector_register=Fact(regs, regs_src, note=regs_note),
        onchip_bytes=Fact(smem, smem_src, note=smem_note), l2_bytes=l2, clock_hz=clock, compute_capability=cc,
        sources={"mma_shapes": Fact({k: list(v) for k, v in mma.items()}, mma_src, note=mma_note),
                 "alignment": Fact(16, NV_MATMUL_GUIDE if chip[0] in "abh" else ROCM_SPECS,
                                   note="operand rows aligned to 16 bytes for the tensor-core path; "
                                        "libraries tile in blocks far larger than one instruction")},
        notes=tuple(notes))


_NV_REG = ("64 K 32-bit registers per SM = 256 KiB", CUDA_SPECS)
NV_A100_DATASHEET = ("NVIDIA A100 datasheet and Ampere architecture whitepaper, https://www.nvidia.com/content/dam/"
                     "en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
NV_HOPPER = ("NVIDIA H100 datasheet and Hopper architecture whitepaper, https://resources.nvidia.com/en-us-tensor-"
             "core/nvidia-tensor-core-gpu-datasheet (H200: the same GH100 die)")
NV_B200_BRIEF = ("NVIDIA Blackwell architecture technical brief (148 SMs), https://resources.nvidia.com/en-us-dgx-"
                 "systems/dgx-b200-datasheet")
TILES.update({
    "a100-80gb": _gpu("a100-80gb", _SM80_MMA, PTX_MMA, "mma.sync (warp-level), sm80", 4, 108, NV_MATMUL_GUIDE,
                      164 * _KIB, CUDA_SPECS, "164 KB shared memory per SM (compute capability 8.0, of 192 KB L1)",
                      256 * _KIB, CUDA_SPECS, _NV_REG[0],
                      die=(40 * _MIB, 1.41e9, (8, 0), NV_A100_DATASHEET, "40 MB L2, 1.41 GHz boost")),
    "h100-sxm": _gpu("h100-sxm", _SM90_MMA, PTX_WGMMA, "wgmma.mma_async (warpgroup of 4 warps), sm90a", 4, 132,
                     NV_MATMUL_GUIDE, 228 * _KIB, CUDA_SPECS, "228 KB shared memory per SM (compute capability 9.0)",
                     256 * _KIB, CUDA_SPECS, _NV_REG[0],
                     die=(50 * _MIB, 1.98e9, (9, 0), NV_HOPPER, "SXM5: 50 MB L2, 1.98 GHz boost")),
    "h200": _gpu("h200", _SM90_MMA, PTX_WGMMA, "wgmma.mma_async, sm90a (same GH100 die as H100)", 4, 132,
                 NV_MATMUL_GUIDE, 228 * _KIB, CUDA_SPECS, "228 KB shared memory per SM (compute capability 9.0)",
                 256 * _KIB, CUDA_SPECS, _NV_REG[0],
                 die=(50 * _MIB, 1.98e9, (9, 0), NV_HOPPER, "as H100: 50 MB L2, 1.98 GHz boost")),
    "b200": _gpu("b200", _SM100_MMA, PTX_TCGEN05, "tcgen05.mma with one CTA (M=128; 256 with a CTA pair), sm100a",
                 4, 148, CUDA_SPECS, 228 * _KIB, CUDA_SPECS, "228 KB shared memory per SM (compute capability 10.0)",
                 256 * _KIB, CUDA_SPECS, _NV_REG[0],
                 notes=("tcgen05 accumulates in tensor memory (256 KB per SM), not registers",),
                 die=(126 * _MIB, 1.965e9, (10, 0), NV_B200_BRIEF, "L2 size and clock are not on an NVIDIA "
                      "datasheet: 126 MB and 1.965 GHz are third-party microbenchmark figures and only steer the "
                      "compiler's tiling")),
    "b300": _gpu("b300", _SM100_MMA, PTX_TCGEN05, "tcgen05.mma (Blackwell Ultra, sm103a; as B200)", 4, 148,
                 CUDA_SPECS, 228 * _KIB, CUDA_SPECS, "228 KB shared memory per SM (Blackwell; as B200, as known)",
                 256 * _KIB, CUDA_SPECS, _NV_REG[0],
                 notes=("SM count and shared memory as B200 (as known; not re-read for B300)",)),
    "gb300": _gpu("gb300", _SM100_MMA, PTX_TCGEN05, "tcgen05.mma (Blackwell Ultra, sm103a; the B300 GPU in a Grace "
                  "Blackwell Ultra superchip)", 4, 148, CUDA_SPECS, 228 * _KIB, CUDA_SPECS,
                  "228 KB shared memory per SM (Blackwell; as B200, as known)", 256 * _KIB, CUDA_SPECS, _NV_REG[0],
                  notes=("the same GPU as b300: SM count and shared memory as B200 (as known; not re-read)",)),
    "mi300x": _gpu("mi300x", _CDNA3_MFMA, AMD_CK_XDLOPS, "MFMA (wavefront of 64), gfx942; 16x16x16 bf16 also exists",
                   4, 304, ROCM_SPECS, 64 * _KIB, ROCM_SPECS, "64 KiB LDS per CU", 512 * _KIB, ROCM_SPECS,
                   "512 KiB VGPR file per CU"),
    "mi355x": _gpu("mi355x", _CDNA4_MFMA, CDNA4_ISA, "MFMA, gfx950 (CDNA4); 16x16x32 bf16 also exists", 4, 256,
                   CDNA4_TLX, 160 * _KIB, CDNA4_TLX, "160 KB LDS per CU", 512 * _KIB, ROCM_SPECS,
                   "512 KiB VGPR file per CU (as CDNA3, as known)"),
})

def chip_key(name: str) -> str:
    """The tile table's key for a chip name, alias or target (`tpu-v5e:2x2`, `h100:8` → `tpu-v5e`, `h100-sxm`)."""
    key = name.strip().lower().split(":")[0]
    if key in TILES:
        return key
    try:  # the catalogue's names and aliases (one alias table for the project)
        key = resolve_name(key)
    except WorkbenchError:
        key = None
    if key in TILES:
        return key
    raise WorkbenchError(f"no tile model for chip {name!r}; known: {', '.join(TILES)} (or `host` where a command "
                         "accepts it)")


def tile_model(name: str) -> TileModel:
    return TILES[chip_key(name)]


# ------------------------------------------------------------------------------------------------ arithmetic

_BITS = {"float64": 64, "float32": 32, "tf32": 32, "int32": 32, "bfloat16": 16, "float16": 16, "int8": 8,
         "uint8": 8, "float8_e4m3fn": 8, "float8_e5m2": 8, "float8_e4m3fnuz": 8, "float8_e5m2fnuz": 8,
         "int4": 4, "float4_e2m1fn": 4}

def canonical_dtype(dtype) -> str:
    """'bf16' -> 'bfloat16', numpy/jax dtypes -> their name; unknown names are a one-line error."""
    name = getattr(dtype, "name", None) or str(dtype)
    d = DTYPE_ALIASES.get(name, name)
    if d not in _BITS:
        raise WorkbenchError(f"unknown dtype {dtype!r}; choose one of {', '.join(_BITS)}")
    return d


def dtype_bits(dtype: str) -> int:
    d = DTYPE_ALIASES.get(str(dtype), str(dtype))
    if d not in _BITS:
        raise WorkbenchError(f"unknown dtype {dtype!r}; choose one of {', '.join(_BITS)}")
    return _BITS[d]


def round_up(x: int, m: int) -> int:
    return -(-int(x) // int(m)) * int(m)


def native_tile(model: TileModel, dtype: str) -> tuple[int, int]:
    """TPU: the (sublanes, lanes) block of one vector register for `dtype`."""
    if model.kind != "tpu":
        raise WorkbenchError(f"{model.chip} is a GPU: it has MMA shapes, not TPU layout tiles")
    bits = max(4, min(32, dtype_bits(dtype)))
    return model.native_tiles[bits]


def mma_shape(model: TileModel, dtype: str) -> tuple[int, int, int]:
    d = DTYPE_ALIASES.get(str(dtype), str(dtype))
    if d in model.mma_shapes:
        return model.mma_shapes[d]
    bits = dtype_bits(d)
    for cand, b in (("bfloat16", 16), ("float32", 32), ("int8", 8)):
        if b >= bits and cand in model.mma_shapes:
            return model.mma_shapes[cand]
    return model.mma_shapes["bfloat16"]


def pad_granule(model: TileModel, dtype: str) -> tuple[int, int, int]:
    """(m, n, k) multiples a matmul's dimensions are rounded up to on this chip's matrix unit (module docstring)."""
    if model.kind == "tpu":
        side = model.matrix_unit.value[0]
        return (native_tile(model, dtype)[0], side, side)
    return mma_shape(model, dtype)


@dataclasses.dataclass(frozen=True)
class PaddedMatmul:
    """One matmul (batch x) m x k @ k x n before and after padding to the matrix unit's granule."""

    m: int
    n: int
    k: int
    batch: int
    granule: tuple[int, int, int]
    m_pad: int
    n_pad: int
    k_pad: int
    flops: float            # 2·batch·m·n·k (useful)
    padded_flops: float     # 2·batch·m_pad·n_pad·k_pad (what the array does)
    bytes: float            # operands read + result written, unpadded
    padded_bytes: float     # the same at the padded shapes (tiles are stored padded)

    @property
    def utilization(self) -> float:
        return self.flops / self.padded_flops if self.padded_flops else 1.0

    @property
    def wasted_flops(self) -> float:
        return self.padded_flops - self.flops

    @property
    def wasted_bytes(self) -> float:
        return self.padded_bytes - self.bytes

    def to_record(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(utilization=self.utilization, wasted_flops=self.wasted_flops, wasted_bytes=self.wasted_bytes)
        return d


def pad_matmul(m: int, n: int, k: int, model: TileModel, dtype: str = "bfloat16", *, batch: int = 1,
               out_dtype: str | None = None) -> PaddedMatmul:
    """Round m, n, k up to the chip's granule; flops and bytes at both sizes (bytes: A and B read once, C written)."""
    for name, v in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        if int(v) < 1:
            raise WorkbenchError(f"matmul {name} must be >= 1, got {v}")
    gm, gn, gk = pad_granule(model, dtype)
    mp, np_, kp = round_up(m, gm), round_up(n, gn), round_up(k, gk)
    b_in = dtype_bits(dtype) / 8
    b_out = dtype_bits(out_dtype or dtype) / 8
    nbytes = batch * ((m * k + k * n) * b_in + m * n * b_out)
    pbytes = batch * ((mp * kp + kp * np_) * b_in + mp * np_ * b_out)
    return PaddedMatmul(int(m), int(n), int(k), int(batch), (gm, gn, gk), mp, np_, kp, 2.0 * batch * m * n * k,
                        2.0 * batch * mp * np_ * kp, float(nbytes), float(pbytes))


def friendly(value: int, multiple: int) -> tuple[int | None, int]:
    """The nearest multiples of `multiple` at or below `value` (None when that is 0) and at or above it."""
    down = (int(value) // multiple) * multiple
    return (down or None), round_up(value, multiple)


def lcm(*xs: int) -> int:
    out = 1
    for x in xs:
        out = out * int(x) // math.gcd(out, int(x))
    return out
