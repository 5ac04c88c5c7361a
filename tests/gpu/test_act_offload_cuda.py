"""fsdp2 ``activation_offload`` on CUDA: the real side streams, events and pinned buffers. Gradients with
offload equal those without up to the run-to-run noise of the kernels (measured in the same test by
a second step without offload); a copy racing with compute would give errors of the gradients' size.

Run on the GPU host: ``UNDERLAY_DEVICE=cuda pytest -q -m gpu tests/gpu``.
"""

from __future__ import annotations

import pytest

from tests._dist import run_distributed
from tests.distributed.test_fsdp2_act_offload import LAYERS, job_offload_equals_plain

pytestmark = pytest.mark.gpu


def test_offload_on_cuda_streams_keeps_gradients() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    names = ["alone", "recompute_tiled"]
    (r,) = run_distributed(job_offload_equals_plain, 1, names, "cuda", backend="nccl", timeout_s=600)
    for name in names:
        res = r[name]
        bound = 8 * res["noise_abs_diff"] + 1e-5 * res["grad_scale"]
        assert res["max_abs_diff"] <= bound, (name, res["max_abs_diff"], res["noise_abs_diff"])
        s = res["stats"]
        assert s["offloaded_tensors"] > 0 and s["prefetched_layers"] == res["micro"] * (LAYERS - 1), s
        assert s["pool_free_after_release"] == 0, s
