#!/usr/bin/env bash
# Issue 8: multi-GPU verification of the FSDP2 engine on 2 GPUs of one host (NCCL), from the repo root:
#
#     bash benchmarks/gpu/multigpu/run_all.sh            # on nvidia-h200-x2 (or larger)
#     DEVICE=cpu bash benchmarks/gpu/multigpu/run_all.sh # smoke run on gloo (no benchmark)
#
# Runs, each with torchrun (NVLink multicast off, as the GPU machine's notes require):
#   1. fsdp2 step equivalence: 1 rank, then 2 ranks compared with it and with a float64 reference
#   2. checkpoint saved on 2 ranks, resumed on 1 (identical next-step loss and weights)
#   3. Ulysses sp=2: forward outputs and gradients against the reference
#   4. vocab-parallel fused log-prob kernel against the unsharded kernel
#   5. fsdp2 throughput at dp=1 and dp=2 (bench_fsdp2.py, weak scaling) and the scaling efficiency
# Every output lands in $OUT (default ./multigpu_out); summary in $OUT/multigpu_summary.json.
# Exit status: the number of failed steps.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
DEVICE="${DEVICE:-cuda}"
OUT="${OUT:-$PWD/multigpu_out}"
export OUT
mkdir -p "$OUT"
HERE=benchmarks/gpu/multigpu
CKPT="$OUT/ckpt_w2"
rm -rf "$CKPT"
fails=0
run() {  # name, nproc, command...
  local name=$1 nproc=$2
  shift 2
  echo "=== $name (nproc $nproc)"
  if python -m torch.distributed.run --standalone --nproc_per_node "$nproc" "$@" >"$OUT/$name.log" 2>&1; then
    echo "    ok"
  else
    echo "    FAILED (see $OUT/$name.log)"
    fails=$((fails + 1))
  fi
  grep -E "PASS|FAIL|: [0-9.e+-]+$|^world|^fsdp2|^hf|speedup" "$OUT/$name.log" | sed 's/^/    /'
}
run step_dp1 1 $HERE/fsdp2_multigpu.py --mode step --device "$DEVICE"
run step_dp2 2 $HERE/fsdp2_multigpu.py --mode step --device "$DEVICE" --compare "$OUT"
run ckpt_save_w2 2 $HERE/fsdp2_multigpu.py --mode save --device "$DEVICE" --ckpt "$CKPT"
run ckpt_resume_w1 1 $HERE/fsdp2_multigpu.py --mode resume --device "$DEVICE" --ckpt "$CKPT"
run ulysses_sp2 2 $HERE/fsdp2_multigpu.py --mode step --device "$DEVICE" --sp 2
if [ "$DEVICE" = cuda ]; then
  run vocab_parallel 2 $HERE/vocab_parallel_logprob.py --device cuda
  run bench_dp1 1 benchmarks/gpu/bench_fsdp2.py --no-baseline
  run bench_dp2 2 benchmarks/gpu/bench_fsdp2.py
else
  run vocab_parallel 2 $HERE/vocab_parallel_logprob.py --device cpu --tokens 256 --hidden 64 --vocab 1024
fi
python - <<'PY'
import json, os, pathlib
out = pathlib.Path(os.environ["OUT"])
summary = {}
for f in sorted(out.glob("*.json")):
    if f.name != "multigpu_summary.json":
        summary[f.stem] = json.loads(f.read_text())
one, two = out / "fsdp2_bench.json", out / "fsdp2_bench_dp2.json"
if one.exists() and two.exists():
    t1 = json.loads(one.read_text())["rows"][0]["tokens_per_s_total"]
    t2 = json.loads(two.read_text())["rows"][0]["tokens_per_s_total"]
    summary["scaling"] = {"tokens_per_s_dp1": t1, "tokens_per_s_dp2": t2, "efficiency": t2 / (2 * t1)}
    print(f"=== dp scaling: {t1:.0f} -> {t2:.0f} tokens/s, efficiency {t2 / (2 * t1):.1%}")
(out / "multigpu_summary.json").write_text(json.dumps(summary, indent=2, default=str))
PY
echo "=== $fails failed step(s); outputs in $OUT"
exit "$fails"
