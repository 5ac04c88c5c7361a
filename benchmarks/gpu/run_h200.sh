#!/usr/bin/env bash
# Every single-GPU check and benchmark of underlay, on one H200, in one call. From the repo root:
#
#     bash benchmarks/gpu/run_h200.sh [STEP ...]      # default: all steps, in the order below
#
# Each step runs with its own time limit; logs and result files go into $OUT/results.tgz, the last lines to stdout.
# Carry .whl (the liger-kernel wheel) for the logprob benchmark. NVLink multicast stays off.
# FSDP2_ARGS / FSDP2_SECS, FP8_ARGS / FP8_SECS: extra arguments and time limit of the fsdp2bench and fp8 steps
# VLM_ARGS / VLM_SECS: extra arguments and time limit of the vlm step (bench_vlm.py, Qwen2.5-VL 3B-shaped, synthetic images)
# LONGSEQ_ARGS / LONGSEQ_SECS: arguments and time limit of the longseq step (65,536-token recompute vs activation offload)
# DEFAULTS_MODELS: which models the defaults step runs (default "qwen2 llama qwen3_4b")
# OFFLOAD8B_ARGS: extra arguments of the offload8b step's bench_fsdp2.py (e.g. --memory-trace)
# LOGPROB_CHECK_ARGS / LOGPROB_SECS: arguments of check_logprob.py (e.g. --both-modes) and the logprob step's limit
# 'mcorecheck': the engine and weight-loader conformance suites against mcore (nccl, world size 1) and
# check_mcore_cuda.py (fp32 vs float64, bf16 vs fsdp2's bf16 error, a Qwen3-MoE step; carry .whl)
# 'fa4probe' / FA4PROBE_ARGS: probe_fa4.py (FA4 against torch's flash kernel); 'fa4conformance': the attention
# contract on the fa4 backend. Both need .fa4/fa4site.tar.xz (carry .fa4), made by benchmarks/gpu/pack_fa4.sh.
# 'processor': check_processor.py (the full Qwen-VL AutoProcessor where torchvision loads)
# 'modelscheck' / MODELSCHECK_SECS: check_models_bf16.py alone (the 'models' step without the memory benchmark)
# 'mcorecuda' / MCORECUDA_SECS: check_mcore_cuda.py alone (its parts print as they finish; carry .whl)
# MCORE_ARGS / MCORE_SECS: extra arguments (e.g. --profile) and time limit of the mcore step (bench_mcore.py: mcore vs fsdp2 at TP=1; carry .whl)
# WEIGHTSIO_ARGS / WEIGHTSIO_SECS: extra arguments (e.g. "--cache cold") and time limit of the weightsio step
# (e.g. FSDP2_ARGS="--act-ckpt none+layer,full+layer --profile", FP8_ARGS="--variants div-sw-t1,rcp-ptx-t2").
# Steps not in the default list: 'defaults' runs bench_fsdp2.py per model, defaults vs tuned (qwen2-1.5b,
# llama-3.2-1b, qwen3-4b; ~540 s); 'offload8b' a Qwen3-8B shape with the defaults (they choose optimizer
# offload; ~390 s). One call each: BUDGET=590 bash benchmarks/gpu/run_h200.sh defaults
set -u
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL="${OUT:-$PWD/gpu_out}"       # what comes back: summary.txt and results.tgz
export OUT=/tmp/underlay_gpu_out   # where each script writes its JSON and files
LOGS="$OUT/logs"
mkdir -p "$FINAL" "$LOGS"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
if ls .fa4/*.tar.xz >/dev/null 2>&1; then  # flash-attn-4 and its CuTe DSL (cu13), unpacked wheels: see probe_fa4.py
  [ -d /tmp/fa4/site ] || { mkdir -p /tmp/fa4 && for a in .fa4/*.tar.xz; do tar xJf "$a" -C /tmp/fa4; done; }
  export PYTHONPATH="/tmp/fa4/site:/tmp/fa4/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
fi
summary="$FINAL/summary.txt"
: > "$summary"
START=$(date +%s)
BUDGET="${BUDGET:-540}"            # seconds for all steps together; later steps are skipped past it
step() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  local t0; t0=$(date +%s)
  local left=$(( BUDGET - (t0 - START) ))
  if [ "$left" -lt 20 ]; then echo "$name skipped (budget)" | tee -a "$summary"; return; fi
  [ "$secs" -gt "$left" ] && secs=$left
  timeout "$secs" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  local line="$name rc=$rc $(( $(date +%s) - t0 ))s"
  echo "$line" >> "$summary"
  echo "===== $line"
  tail -n "${TAIL:-30}" "$LOGS/$name.log"
}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env conformance gputests attention models logprob fp8 nvtx fsdp2check fsdp2bench vlm longseq demo weightsync weightsio)
for s in "${steps[@]}"; do
  case $s in
    env) step env 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import sys,torch,triton,transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__)"; git log -1 --format=%H 2>/dev/null || true' ;;
    conformance) step conformance 240 env UNDERLAY_DEVICE=cuda python3 -m pytest -q -rs -p no:cacheprovider tests/conformance ;;
    gputests) step gputests 240 env UNDERLAY_DEVICE=cuda python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests ;;
    attention) step attention 180 python3 benchmarks/gpu/bench_attention.py ;;
    fa4probe) step fa4probe "${FA4PROBE_SECS:-200}" python3 benchmarks/gpu/probe_fa4.py ${FA4PROBE_ARGS:-} ;;
    fa4conformance) step fa4conformance 150 env UNDERLAY_DEVICE=cuda python3 -m pytest -q -rs -p no:cacheprovider tests/conformance/test_attention_contract.py -k fa4 ;;
    models) step models 240 bash -c 'python3 benchmarks/gpu/check_models_bf16.py; python3 benchmarks/gpu/bench_models_memory.py' ;;
    processor) step processor 90 python3 benchmarks/gpu/check_processor.py ;;
    modelscheck) step modelscheck "${MODELSCHECK_SECS:-200}" python3 benchmarks/gpu/check_models_bf16.py ;;
    logprobbench) step logprobbench 150 python3 benchmarks/gpu/bench_logprob.py ;;
    logprob) step logprob "${LOGPROB_SECS:-300}" bash -c "python3 benchmarks/gpu/check_logprob.py ${LOGPROB_CHECK_ARGS:-}; python3 benchmarks/gpu/bench_logprob.py" ;;
    logprofile) step logprofile 200 python3 benchmarks/gpu/profile_logprob.py ;;
    fp8) step fp8 "${FP8_SECS:-300}" python3 benchmarks/gpu/bench_fp8.py ${FP8_ARGS:-} ;;
    fp8diag) step fp8diag 60 python3 benchmarks/gpu/diag_fp8.py ;;
    fp8tests) step fp8tests 120 env UNDERLAY_DEVICE=cuda python3 -m pytest -q -rs -p no:cacheprovider -m gpu -k fp8 tests ;;
    nvtx) step nvtx 90 python3 benchmarks/gpu/check_nvtx.py ;;
    fsdp2check) step fsdp2check 240 python3 benchmarks/gpu/check_fsdp2_cuda.py ;;
    defaults)  # issue 23: the engine's defaults vs the tuned options, one model per sub-step
      B="python3 benchmarks/gpu/bench_fsdp2.py --no-baseline --steps 3 --warmup 2"
      for m in ${DEFAULTS_MODELS:-qwen2 llama qwen3_4b}; do
        case $m in
          qwen2) step defaults_qwen2 150 $B --model qwen2-1.5b --act-ckpt defaults,tuned ;;
          llama) step defaults_llama 150 $B --model llama-3.2-1b --act-ckpt defaults,tuned ;;
          qwen3_4b) step defaults_qwen3_4b 240 $B --model qwen3-4b --sequences 32 --act-ckpt defaults,tuned ;;
        esac
      done ;;
    offload8b)  # issue 23: the offloaded AdamW alone (bit-equality, GB/s), then a Qwen3-8B shape on one GPU with the defaults (they choose optimizer offload)
      step optimoffload 90 python3 benchmarks/gpu/check_optim_offload.py --out "$OUT/optim_offload"
      step offload8b 300 python3 benchmarks/gpu/bench_fsdp2.py --no-baseline --model qwen3-8b --sequences 32 --steps 2 --warmup 1 --act-ckpt defaults ${OFFLOAD8B_ARGS:-} ;;
    vlm) step vlm "${VLM_SECS:-180}" python3 benchmarks/gpu/bench_vlm.py --out "$OUT" ${VLM_ARGS:-} ;;
    fsdp2bench) step fsdp2bench "${FSDP2_SECS:-330}" python3 benchmarks/gpu/bench_fsdp2.py ${FSDP2_ARGS:-} ;;
    demo) step demo 240 python3 benchmarks/gpu/demo_cuda.py ;;
    longseq) step longseq "${LONGSEQ_SECS:-200}" python3 benchmarks/gpu/bench_long_seq.py --out "$OUT/longseq" ${LONGSEQ_ARGS:-} ;;
    weightsync) step weightsync 300 python3 benchmarks/gpu/bench_weight_sync.py ${WEIGHTSYNC_ARGS:-} ;;
    mcorecheck) step mcorecheck "${MCORECHECK_SECS:-240}" bash -c 'UNDERLAY_DEVICE=cuda python3 -m pytest -q -rs -p no:cacheprovider tests/conformance/test_engine_contract.py tests/conformance/test_weight_loader_contract.py -k mcore; python3 benchmarks/gpu/check_mcore_cuda.py --out "$OUT/mcore"' ;;
    mcorecuda) step mcorecuda "${MCORECUDA_SECS:-300}" python3 benchmarks/gpu/check_mcore_cuda.py --out "$OUT/mcore" ;;
    mcore) step mcore "${MCORE_SECS:-240}" python3 benchmarks/gpu/bench_mcore.py --out "$OUT/mcore" ${MCORE_ARGS:-} ;;
    weightsio) step weightsio "${WEIGHTSIO_SECS:-150}" python3 benchmarks/gpu/bench_weights_io.py ${WEIGHTSIO_ARGS:-} ;;
    *) echo "unknown step $s" | tee -a "$summary" ;;
  esac
done
tar czf "$FINAL/results.tgz" -C "$OUT" .
echo "===== summary"; cat "$summary"
