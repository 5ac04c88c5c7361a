"""Why the model matrix compares packings with row-invariant float64 products
(``_matrix.row_invariant_products``): with the platform's products two packings of dbrx and phimoe
differ by 1 ulp in float64 (``coverage.NOT_EXACT`` tells the history), each part shown on its own:

1. a float64 matrix product's row depends on the rows next to it (MKL computes rows in blocks; the
   rows left over take another summation order), by about 1 ulp;
2. transformers' RMSNorm computes in fp32 and rounds such a difference away; a float64 ``nn.LayerNorm``
   (dbrx, phimoe) keeps it;
3. through the whole model: the packings differ, and computing every float64 product a row at a time
   (each row alone, so no row has neighbours) makes them bit-equal. llama shows the same with another
   layout of sequence lengths: the effect is BLAS's, not the MoE block's, nor underlay's packing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from tests.unit.models._matrix import LENGTHS, packing_diff, row_invariant_products
from underlay.models import coverage

EPS = torch.finfo(torch.float64).eps


def _mkl_avx2() -> bool:
    """Whether MKL runs its AVX2 kernels here: an AVX2 host without AVX512. (MKL picks its kernels
    from the CPU itself; tests/conftest.py's ``ATEN_CPU_CAPABILITY`` pin moves PyTorch's own kernels
    only, so ``torch.backends.cpu.get_cpu_capability()`` cannot tell; ``MKL_ENABLE_INSTRUCTIONS=AVX2``
    on an AVX512 host was seen to block rows otherwise than an AVX2 host.)"""
    if not torch.backends.mkl.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " avx512f" not in flags


MKL_AVX2 = _mkl_avx2()
"""The BLAS these facts were isolated on (MKL's AVX2 float64 gemm, the CI machine's). Which rows differ,
and whether a given layout shows a difference at all, is that library's blocking: elsewhere only the
bounds and the row-at-a-time equality are asserted (they hold for any BLAS)."""


def test_gemm_row_depends_on_its_neighbours() -> None:
    """Minimal reproduction, plain torch: rows of ``x[:m] @ w.T`` against the same rows of
    ``x @ w.T`` (17 rows). Some rows differ, each element by at most 2 eps of its terms' magnitude
    ``sum_k |x_ik w_jk|`` (a rounding-order difference, ~1 ulp of the terms; the result itself may be
    smaller by cancellation); with MKL's AVX2 kernel exactly the trailing ``m mod 4`` rows do, and
    (past one block) they equal the product of that row alone."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(17, 32, generator=g, dtype=torch.float64)
    w = torch.randn(48, 32, generator=g, dtype=torch.float64)
    full = F.linear(x, w)
    alone = torch.cat([F.linear(x[i : i + 1], w) for i in range(17)])
    differing: dict[int, list[int]] = {}
    for m in range(1, 17):
        part = F.linear(x[:m], w)
        scale = x[:m].abs() @ w.abs().T
        assert bool(((part - full[:m]).abs() <= 2 * EPS * scale).all()), m
        differing[m] = [i for i in range(m) if not torch.equal(part[i], full[i])]
    if MKL_AVX2:
        assert any(differing.values()), "every row of every product equals the 17-row product's"
        for m, rows in differing.items():
            assert rows == list(range(m - m % 4, m)), (m, rows)
            if m > 4:  # below one block MKL takes yet another path
                assert all(torch.equal(F.linear(x[:m], w)[i], alone[i]) for i in rows), m


def test_fp32_rmsnorm_absorbs_a_ulp_float64_layernorm_keeps_it() -> None:
    """A hidden state nudged by 1 ulp in every element: transformers' RMSNorm (fp32 inside, cast back)
    gives the same float64 output; ``nn.LayerNorm`` in float64 (dbrx's and phimoe's) does not (by a
    few eps of its output's scale)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    h = torch.randn(17, 32, generator=g, dtype=torch.float64)
    nudged = torch.nextafter(h, torch.tensor(float("inf"), dtype=h.dtype))
    rms = LlamaRMSNorm(32).double()
    ln = torch.nn.LayerNorm(32).double()
    with torch.no_grad():
        assert torch.equal(rms(h), rms(nudged))
        assert not torch.equal(ln(h), ln(nudged))
        out = ln(h)
        assert float((ln(nudged) - out).abs().max()) <= 4 * EPS * float(out.abs().max())


@pytest.fixture
def row_invariant(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``_matrix.row_invariant_products`` around the test."""
    with row_invariant_products():
        yield


CASES = [("dbrx", LENGTHS), ("phimoe", LENGTHS), ("llama", [5, 9, 4])]
"""dbrx and phimoe with the matrix test's lengths, and llama with lengths whose pack of 18 leaves rows
16-17 to the remainder path (row 16 predicts a scored token)."""


@pytest.mark.parametrize(("model_type", "lengths"), CASES, ids=[c[0] for c in CASES])
def test_packings_differ_by_ulps_from_blas_rows(model_type: str, lengths: list[int]) -> None:
    assert model_type in coverage.EXACT["fsdp2"]
    diff = packing_diff(model_type, lengths)
    assert diff <= 16 * EPS * 8, diff  # log-probs of magnitude < 8: a few ulp
    if MKL_AVX2:
        assert diff > 0.0, "these layouts differ with MKL's AVX2 blocking"


@pytest.mark.parametrize(("model_type", "lengths"), CASES, ids=[c[0] for c in CASES])
def test_row_invariant_products_make_packings_bit_equal(
    model_type: str, lengths: list[int], row_invariant: None
) -> None:
    assert packing_diff(model_type, lengths) == 0.0
