"""Products of a few rows by a large float32 matrix at about the speed the CPU reads the matrix: the client's LM head
for the decode steps of concurrent generations (client/head_batching.py).

A decode step's head product is bound by reading the weight (113 MB for SmolLM2), and rows of concurrent steps
stacked into one product read it once. MKL, torch's CPU BLAS, does not pay that off for a few rows: 2 or 4 rows take
about 2 or 3 times as long as 1 (`python bench/head_batch.py`). rows_kernel.c reads a copy of the weight packed
for it front to back once for up to 8 rows (4 without AVX-512), so that 2 rows cost about what 1 costs, and 4 rows
about 1.4 times as much.

The kernel is compiled on first use by the machine's C compiler ($CC, else cc or gcc on PATH) for the CPU it runs on
(-O3 -march=native), and kept in the user's cache directory ($XDG_CACHE_HOME or ~/.cache, under swarmlm/kernels),
keyed by its source, the compiler and the CPU. Without a compiler, when the build fails or its result does not
match torch's product, or with SWARMLM_NO_KERNEL=1 in the environment, kernel() is None and products run as
torch runs them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 - the usual name

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rows_kernel.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
# products of more rows than this run as torch runs them (the kernel reads the weight once per 8 rows; beyond 12,
# MKL's general product is as fast)
MAX_ROWS = 12
COMPILE_TIMEOUT_S = 120.0
DISABLE_ENV = "SWARMLM_NO_KERNEL"

_lock = threading.Lock()
_loaded: dict[tuple[str | None, str | None], RowsKernel | None] = {}  # by $CC and $XDG_CACHE_HOME


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A (out_features, in_features) weight in the kernel's layout (rows_kernel.c), padded to `padded_in` columns."""

    data: torch.Tensor
    out_features: int
    in_features: int
    padded_in: int


class RowsKernel:
    """The compiled kernel: pack(weight) once, then product(rows, packed) as often as needed."""

    def __init__(self, library: ctypes.CDLL):
        self._library = library  # kept alive as long as its functions are used
        self._product = library.rows_product
        self._product.restype = ctypes.c_int
        self._product.argtypes = [
            ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
            ctypes.c_long, ctypes.c_long,
        ]  # fmt: skip
        library.rows_lanes.restype = ctypes.c_int
        self.lanes = int(library.rows_lanes())

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """The kernel's copy of a float32 CPU weight (out, in): as large as the weight, plus padding."""
        if not float32_cpu_matrix(weight):
            raise ValueError("the kernel packs float32 CPU matrices only")
        out_features, in_features = weight.shape
        padded_in = -(-in_features // self.lanes) * self.lanes
        padded_out = out_features + out_features % 2
        weight = weight.detach()
        if (padded_out, padded_in) != (out_features, in_features):
            weight = F.pad(weight, (0, padded_in - in_features, 0, padded_out - out_features))
        data = weight.reshape(padded_out // 2, 2, padded_in // self.lanes, self.lanes).permute(0, 2, 1, 3).contiguous()
        return PackedWeight(data, out_features, in_features, padded_in)

    def product(self, rows: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """rows (m, in_features) times the packed weight, transposed (+ bias): (m, out_features)."""
        if rows.dim() != 2 or rows.shape[1] != packed.in_features or rows.dtype != torch.float32:
            raise ValueError(f"rows of shape (m, {packed.in_features}) in float32 expected, got "
                             f"{tuple(rows.shape)} {rows.dtype}")  # fmt: skip
        if rows.device.type != "cpu":
            raise ValueError("the kernel multiplies CPU tensors only")
        if packed.padded_in != packed.in_features:
            rows = F.pad(rows, (0, packed.padded_in - packed.in_features))
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], packed.out_features, dtype=torch.float32)
        if rows.shape[0]:
            status = self._product(
                rows.data_ptr(), packed.padded_in, packed.data.data_ptr(), packed.out_features, packed.padded_in,
                out.data_ptr(), packed.out_features, rows.shape[0],
            )  # fmt: skip
            if status != 0:
                raise RuntimeError(f"the rows kernel refused a product of shape {tuple(rows.shape)} ({status})")
        if bias is not None:
            out += bias
        return out


def float32_cpu_matrix(weight: torch.Tensor) -> bool:
    """Whether `weight` is a float32 CPU matrix (what the kernel, and MKL's packing, multiply by)."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2


def kernel() -> RowsKernel | None:
    """The kernel, built or loaded on the first call; None where it cannot be had (products then run in torch)."""
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return None
    settings = (os.environ.get("CC"), os.environ.get("XDG_CACHE_HOME"))  # what decides which library it is
    with _lock:
        if settings not in _loaded:
            _loaded[settings] = _find()
        return _loaded[settings]


def _find() -> RowsKernel | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("the LM head runs in torch: no C compiler for its rows kernel (set CC, or install gcc)")
        return None
    return _load(compiler, cache_dir() / f"rows_kernel-{_fingerprint(compiler)}.so")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "swarmlm" / "kernels"


def _fingerprint(compiler: str) -> str:
    """What the compiled library depends on: the source, the compiler and its flags, and this CPU (-march=native)."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join([compiler, *FLAGS, platform.machine()]).encode())
    digest.update(_cpu_identity().encode())
    return digest.hexdigest()[:20]


def _cpu_identity() -> str:
    """The CPU's model and feature flags (Linux), which decide what -march=native builds."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _load(compiler: str, library: Path) -> RowsKernel | None:
    """Build the library unless it is there, load it, and check it against torch's product."""
    try:
        if not library.exists():
            _build(compiler, library)
        loaded = RowsKernel(ctypes.CDLL(str(library)))
        _check(loaded)
    except (OSError, RuntimeError, ValueError, AssertionError, subprocess.SubprocessError) as e:
        text = str(e).strip().splitlines()
        logger.warning("the LM head runs in torch: its rows kernel is not usable here (%s)",
                       text[-1] if text else type(e).__name__)  # fmt: skip
        return None
    logger.debug("rows kernel ready: %s (%d lanes)", library, loaded.lanes)
    return loaded


def _build(compiler: str, library: Path) -> None:
    """Compile into a temporary file beside the target, then move it into place: processes that build at once each
    leave a whole library, never a half-written one."""
    library.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=library.stem, suffix=".so.tmp", dir=library.parent)
    os.close(handle)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, "-o", temporary, str(SOURCE)],
            capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {(done.stderr or done.stdout).strip()[-400:]}")
        os.replace(temporary, library)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _check(loaded: RowsKernel) -> None:
    """The kernel's product matches torch's on odd shapes (padding on both sides) and on every row count."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 3 * loaded.lanes + 5, generator=generator)
    packed = loaded.pack(weight)
    for rows in range(1, MAX_ROWS + 1):
        x = torch.randn(rows, weight.shape[1], generator=generator)
        torch.testing.assert_close(loaded.product(x, packed), F.linear(x, weight), rtol=1e-4, atol=1e-4)
