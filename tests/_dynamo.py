"""The message of a test that expected ``torch.compile`` graphs and found none: a graph break or a
swallowed compile error leaves the code eager and the backend uncalled, and this says which."""

from __future__ import annotations

import torch


def dynamo_report() -> str:
    """Dynamo's graph-break and unsupported-feature counters (since the last ``counters.clear()``),
    plus the settings that make it fall back to eager silently."""
    from torch._dynamo.utils import counters

    cfg = torch._dynamo.config
    return (
        f"graph_break={dict(counters['graph_break'])} unimplemented={dict(counters['unimplemented'])} "
        f"stats={dict(counters['stats'])} suppress_errors={cfg.suppress_errors} disable={cfg.disable} "
        f"grad_enabled={torch.is_grad_enabled()} threads={torch.get_num_threads()}"
    )
