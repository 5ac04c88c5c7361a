import sys, torch, tempfile
from pathlib import Path
from tests.integrations.verl import test_verl_engine as T
from tests._dist import run_distributed

def fn(rank, world, critic):
    import underlay.integrations.verl
    from verl.workers.engine import EngineRegistry
    from transformers import AutoModelForTokenClassification
    rows = T._rows()
    common = {"temperature": 1.0, "global_batch_size": T.B, "calculate_entropy": True}
    c = EngineRegistry.new(**T._configs(critic, "value_model", 1e-3, micro_batch_max_tokens=64))
    c.initialize()
    td = T._verl_batch(rows, **common)
    v = c.infer_batch(td)["model_output"]["values"]
    ref = AutoModelForTokenClassification.from_pretrained(critic, dtype=torch.float64)
    rv = T._ref_outputs(ref, td, True)["values"]
    for a, b in zip(v.unbind(), rv.unbind()):
        print("V", a[:4].tolist(), b[:4].tolist(), flush=True)
    print({k: tuple(p.shape) for k, p in ref.named_parameters() if "score" in k})
    print([ (n, tuple(t.shape)) for n, t in c.get_per_tensor_param()[0] if "score" in n])

if __name__ == "__main__":
    d = tempfile.mkdtemp()
    p, c = T._tiny(Path(d))
    run_distributed(fn, 1, c)
