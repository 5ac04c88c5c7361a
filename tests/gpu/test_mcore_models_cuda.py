"""The mcore architectures of ``tests/mcore/test_mcore_models.py`` (Llama 3 RoPE scaling, sliding
windows, mixtral, qwen2_moe, glm4_moe, deepseek_v3) on cuda at world size 1: log-probs and gradients against
transformers' float64 forward, and ``load_hf`` -> ``iter_weights`` bit-exact. The engine's cuda
defaults apply (compiled elementwise kernels, the registry's attention kernel), so tolerances are
those of fp32 up to reassociation.

Run on the GPU host: ``UNDERLAY_DEVICE=cuda pytest -q -m gpu tests/gpu/test_mcore_models_cuda.py``
(needs megatron-core; skipped otherwise).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

LP_TOL = 2e-5
GRAD_TOL = 1e-4


def test_mcore_architectures_on_cuda(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests._dist import run_distributed
    from tests.mcore import _model_archs as A

    A.write_checkpoints(tmp_path)
    (res,) = run_distributed(
        A.check_layout_all_archs, 1, 1, 1, str(tmp_path), "cuda", timeout_s=600, backend="nccl"
    )
    assert set(res) == set(A.arch_configs())
    for name, r in res.items():
        assert "refused" not in r, (name, r)
        assert r["lp"] < LP_TOL, (name, r)
        assert r["grad_rel"] < GRAD_TOL, (name, r)
        assert r["grad_names"] == 1.0 and r["names"] == 1.0, (name, r)
        assert r["roundtrip"] == 0.0, (name, r)
