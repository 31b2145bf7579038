"""The rows kernel of the client's LM head: built at install, each variant this CPU runs equal to torch's product on
every shape and row count, the same bits for a row alone or among others, and torch's product wherever it cannot be
had."""

from __future__ import annotations

import platform
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from swarmlm.client import rows_kernel
from swarmlm.client.head_batching import HeadBatcher

COMPILER = shutil.which("cc") or shutil.which("gcc")
CPU_FLAGS = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
# the wide variants are built for x86-64 by GCC, the compiler Python's own build names (sysconfig's CC)
WIDE_BUILT = platform.machine() == "x86_64" and "clang" not in (sysconfig.get_config_var("CC") or "")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """No library loaded yet in this process, and the kernel not turned off."""
    monkeypatch.delenv(rows_kernel.DISABLE_ENV, raising=False)
    monkeypatch.setattr(rows_kernel, "_loaded", {})


@pytest.fixture(params=[4, 8, 16], ids=lambda lanes: f"{lanes}-lanes")
def kernel(request: pytest.FixtureRequest, fresh: None) -> rows_kernel.RowsKernel:
    """Each variant of the kernel this CPU runs (4 floats per vector on any CPU, 8 with AVX2 and FMA, 16 with
    AVX-512 on x86-64)."""
    _require_the_library()
    loaded = rows_kernel.kernel(request.param)
    if loaded is None:
        assert request.param not in _expected_variants(), f"this CPU runs the {request.param}-lane variant"
        pytest.skip(f"this CPU does not run the {request.param}-lane variant")
    assert loaded.lanes == request.param
    return loaded


def _require_the_library() -> None:
    if rows_kernel.library_path() is None:
        assert COMPILER is None, "a C compiler is on PATH, yet the rows kernel was not built at install"
        pytest.skip("no C compiler here: the kernel was not built, products run in torch")


def _expected_variants() -> set[int]:
    """The variants the CPU's flags say it runs (x86-64 Linux; elsewhere only the portable one is built)."""
    if not WIDE_BUILT:
        return {4}
    return {4} | ({8} if {"avx2", "fma"} <= CPU_FLAGS else set()) | ({16} if "avx512f" in CPU_FLAGS else set())


def test_the_installed_kernel_runs_the_widest_variant_of_this_cpu(fresh: None) -> None:
    _require_the_library()
    loaded = rows_kernel.kernel()
    assert loaded is not None and rows_kernel.kernel() is loaded  # loaded once per process
    assert loaded.lanes == max(_expected_variants())
    assert {lanes for lanes in (4, 8, 16) if rows_kernel.kernel(lanes) is not None} == _expected_variants()


@pytest.mark.parametrize(("out_features", "in_features"), [(1, 1), (37, 40), (300, 64), (49, 50), (2, 576)])
def test_products_equal_torch_for_any_shape_and_row_count(kernel, out_features: int, in_features: int) -> None:
    """Odd outputs and inputs that are no multiple of the vector width are padded; 0 to MAX_ROWS rows, in passes."""
    torch.manual_seed(out_features * 1000 + in_features)
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    packed = kernel.pack(weight)
    atol = 2e-6 * in_features**0.5  # float32 rounding of sums of in_features unit-variance products
    for rows in range(rows_kernel.MAX_ROWS + 1):
        x = torch.randn(rows, in_features)
        exact = F.linear(x.double(), weight.double())
        torch.testing.assert_close(kernel.product(x, packed), exact.float(), rtol=1e-5, atol=atol)
        torch.testing.assert_close(kernel.product(x, packed, bias), (exact + bias).float(), rtol=1e-5, atol=atol)
        torch.testing.assert_close(kernel.product(x, packed), F.linear(x, weight), rtol=1e-5, atol=2 * atol)


def test_a_row_gets_the_same_bits_alone_or_among_others(kernel) -> None:
    torch.manual_seed(1)
    weight = torch.randn(101, 96)
    packed = kernel.pack(weight)
    x = torch.randn(rows_kernel.MAX_ROWS, 96)
    alone = torch.cat([kernel.product(x[i : i + 1], packed) for i in range(x.shape[0])])
    for rows in range(1, x.shape[0] + 1):
        assert torch.equal(kernel.product(x[:rows], packed), alone[:rows])
    assert torch.equal(kernel.product(x[3:].t().contiguous().t(), packed), alone[3:])  # strided rows are copied


def test_wrong_inputs_get_clear_errors(kernel) -> None:
    packed = kernel.pack(torch.randn(10, 20))
    with pytest.raises(ValueError, match=r"\(m, 20\)"):
        kernel.product(torch.randn(2, 21), packed)
    with pytest.raises(ValueError, match="float32"):
        kernel.product(torch.randn(2, 20, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="float32 CPU matrices"):
        kernel.pack(torch.randn(10, 20, dtype=torch.bfloat16))


@pytest.mark.parametrize("how", ["not built", "a library that is not the kernel", "turned off"])
def test_without_the_kernel_the_head_runs_in_torch(fresh: None, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    if how == "not built":
        monkeypatch.setattr(rows_kernel, "LIBRARY", "swarmlm.client._no_such_library")
    elif how == "a library that is not the kernel":
        monkeypatch.setattr(rows_kernel, "LIBRARY", "_ctypes")  # a shared library without the kernel's functions
    else:
        monkeypatch.setenv(rows_kernel.DISABLE_ENV, "1")
    assert rows_kernel.kernel() is None
    torch.manual_seed(2)
    head = torch.nn.Linear(64, 300, bias=True)
    with torch.no_grad():
        for rows in (1, 5):
            hidden = torch.randn(rows, 1, 64)
            torch.testing.assert_close(HeadBatcher()(head, hidden), head(hidden), rtol=1e-5, atol=1e-5)


def test_a_head_batcher_follows_the_kernel_being_turned_off(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's copy serves only while the kernel does: turned off, the batcher makes MKL's copy (or none)."""
    torch.manual_seed(3)
    head, batcher = torch.nn.Linear(64, 300, bias=True), HeadBatcher()
    hidden = torch.randn(3, 1, 64)
    with torch.no_grad():
        torch.testing.assert_close(batcher(head, hidden), head(hidden), rtol=1e-5, atol=1e-5)
        assert isinstance(batcher._packed[id(head)][3], rows_kernel.PackedWeight)
        monkeypatch.setenv(rows_kernel.DISABLE_ENV, "1")
        torch.testing.assert_close(batcher(head, hidden), head(hidden), rtol=1e-5, atol=1e-5)
        assert not isinstance(batcher._packed[id(head)][3], rows_kernel.PackedWeight)
