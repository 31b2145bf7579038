"""The rows kernel of the client's LM head: built here with the machine's compiler, equal to torch's product on every
shape and row count, the same bits for a row alone or among others, and torch's product wherever it cannot be had."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the usual name

from swarmlm.client import rows_kernel
from swarmlm.client.head_batching import HeadBatcher

COMPILER = shutil.which("cc") or shutil.which("gcc")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty kernel cache directory, and no library loaded yet in this process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(rows_kernel.DISABLE_ENV, raising=False)
    monkeypatch.setattr(rows_kernel, "_loaded", {})
    return tmp_path / "swarmlm" / "kernels"


@pytest.fixture
def kernel() -> rows_kernel.RowsKernel:
    loaded = rows_kernel.kernel()
    if COMPILER is not None:
        assert loaded is not None, "a C compiler is on PATH, yet the rows kernel was not built (see the log)"
    if loaded is None:
        pytest.skip("no C compiler here: the kernel cannot be built, products run in torch")
    return loaded


def test_a_machine_with_a_c_compiler_builds_the_kernel_once(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = rows_kernel.kernel()
    assert (loaded is not None) == (COMPILER is not None)
    if loaded is None:
        return
    assert loaded.lanes in (4, 8, 16)
    (library,) = fresh.glob("rows_kernel-*.so")  # nothing half-written is left beside it
    assert rows_kernel.kernel() is loaded  # loaded once per process

    def no_build(*args: object) -> None:
        raise AssertionError("built again although the library is in the cache")

    monkeypatch.setattr(rows_kernel, "_loaded", {})  # as another process would: the library is reused
    monkeypatch.setattr(rows_kernel, "_build", no_build)
    assert rows_kernel.kernel() is not None


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


@pytest.mark.parametrize("how", ["no compiler", "a compiler that fails", "turned off"])
def test_without_the_kernel_the_head_runs_in_torch(fresh: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    if how == "no compiler":
        monkeypatch.setenv("CC", str(fresh / "no-such-cc"))
    elif how == "a compiler that fails":
        monkeypatch.setenv("CC", "false")
    else:
        monkeypatch.setenv(rows_kernel.DISABLE_ENV, "1")
    assert rows_kernel.kernel() is None
    assert not list(fresh.glob("*.so*"))  # no library, and no temporary file left
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
