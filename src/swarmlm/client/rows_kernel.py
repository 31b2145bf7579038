"""Products of a few rows by a large float32 matrix at about the speed the CPU reads the matrix: the client's LM head
for the decode steps of concurrent generations (client/head_batching.py).

A decode step's head product is bound by reading the weight (113 MB for SmolLM2), and rows of concurrent steps
stacked into one product read it once. MKL, torch's CPU BLAS, does not pay that off for a few rows: 2 or 4 rows take
about 2 or 3 times as long as 1 (`python bench/head_batch.py`). rows_kernel.c reads a copy of the weight packed
for it front to back once for up to 8 rows (4 without AVX-512), so that 2 rows cost about what 1 costs, and 4 rows
about 1.4 times as much.

The kernel is a small C library built when the package is installed (pyproject.toml: one portable build holding a
variant per vector width, of which it runs the widest this CPU has). Where it was not built (no C compiler at
install, or the package run from a source tree without installing it), when it does not match torch's product, or
with SWARMLM_NO_KERNEL=1 in the environment, kernel() is None and products run as torch runs them.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

LIBRARY = "swarmlm.client._rows_kernel"  # the built library's name, as an extension module (pyproject.toml)
# products of more rows than this run as torch runs them (the kernel reads the weight once per 8 rows; beyond 12,
# MKL's general product is as fast)
MAX_ROWS = 12
DISABLE_ENV = "SWARMLM_NO_KERNEL"

_lock = threading.Lock()
_loaded: dict[int | None, RowsKernel | None] = {}  # by the vector width asked for (None: the widest)


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A (out_features, in_features) weight in the kernel's layout (rows_kernel.c), padded to `padded_in` columns."""

    data: torch.Tensor
    out_features: int
    in_features: int
    padded_in: int


class RowsKernel:
    """The compiled kernel: pack(weight) once, then product(rows, packed) as often as needed."""

    def __init__(self, library: ctypes.CDLL, lanes: int):
        self._library = library  # kept alive as long as its functions are used
        self._product = library.rows_product_lanes
        self._product.restype = ctypes.c_int
        self._product.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
            ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
        ]  # fmt: skip
        self.lanes = lanes  # the variant it runs: floats per vector

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
            raise ValueError(
                f"rows of shape (m, {packed.in_features}) in float32 expected, got {tuple(rows.shape)} {rows.dtype}"
            )
        if rows.device.type != "cpu":
            raise ValueError("the kernel multiplies CPU tensors only")
        if packed.padded_in != packed.in_features:
            rows = F.pad(rows, (0, packed.padded_in - packed.in_features))
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], packed.out_features, dtype=torch.float32)
        if rows.shape[0]:
            status = self._product(
                self.lanes, rows.data_ptr(), packed.padded_in, packed.data.data_ptr(), packed.out_features,
                packed.padded_in, out.data_ptr(), packed.out_features, rows.shape[0],
            )  # fmt: skip
            if status != 0:
                raise RuntimeError(f"the rows kernel refused a product of shape {tuple(rows.shape)} ({status})")
        if bias is not None:
            out += bias
        return out


def float32_cpu_matrix(weight: torch.Tensor) -> bool:
    """Whether `weight` is a float32 CPU matrix (what the kernel, and MKL's packing, multiply by)."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2


def kernel(lanes: int | None = None) -> RowsKernel | None:
    """The kernel, loaded on the first call; None where it cannot be had (products then run in torch). `lanes` asks
    for one variant (4, 8 or 16 floats per vector) instead of the widest this CPU runs; None where the CPU lacks it."""
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return None
    with _lock:
        if lanes not in _loaded:
            _loaded[lanes] = _load(lanes)
        return _loaded[lanes]


def library_path() -> str | None:
    """Where the installed library is, or None where it was not built."""
    spec = importlib.util.find_spec(LIBRARY)
    return spec.origin if spec is not None else None


def _load(lanes: int | None) -> RowsKernel | None:
    """Load the library, pick its variant, and check it against torch's product."""
    path = library_path()
    if path is None:
        logger.info("the LM head runs in torch: its rows kernel was not built when swarmlm was installed "
                    "(install it with a C compiler on PATH to build it)")  # fmt: skip
        return None
    try:
        library = ctypes.CDLL(path)
        library.rows_supports.restype = library.rows_lanes.restype = ctypes.c_int
        library.rows_supports.argtypes = [ctypes.c_int]
        if lanes is not None and not library.rows_supports(lanes):
            return None
        loaded = RowsKernel(library, lanes or int(library.rows_lanes()))
        _check(loaded)
    except (OSError, AttributeError, RuntimeError, ValueError, AssertionError) as e:
        text = str(e).strip().splitlines()
        logger.warning("the LM head runs in torch: its rows kernel is not usable here (%s)",
                       text[-1] if text else type(e).__name__)  # fmt: skip
        return None
    logger.debug("rows kernel ready: %s (%d lanes)", path, loaded.lanes)
    return loaded


def _check(loaded: RowsKernel) -> None:
    """The kernel's product matches torch's on odd shapes (padding on both sides) and on every row count."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 3 * loaded.lanes + 5, generator=generator)
    packed = loaded.pack(weight)
    for rows in range(1, MAX_ROWS + 1):
        x = torch.randn(rows, weight.shape[1], generator=generator)
        torch.testing.assert_close(loaded.product(x, packed), F.linear(x, weight), rtol=1e-4, atol=1e-4)
