"""Device-agnostic backends in plain torch: eager/torch attention, chunked log-prob kernel, torch/off profilers."""
