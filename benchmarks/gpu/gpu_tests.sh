#!/bin/bash
# The GPU half of Turbine's checks (issue #29), on an offline GPU host with the bundle installed
# (benchmarks/gpu/gpu_site_bundle.sh here, benchmarks/gpu/gpu_install.sh there), from the checkout the device tool
# sends. Each step writes under $OUT (default /tmp/gpu-out); run them in one call or several (STEP_TIMEOUT=SECONDS
# bounds each, see below):
#
#   bash benchmarks/gpu/gpu_tests.sh sweep            every turbine.* module imported on the host's vLLM/torch/CUDA
#   bash benchmarks/gpu/gpu_tests.sh tests [ARGS]     the integration modules whose features differ on a GPU, run
#                                                 there by pytest as in CI: KV tiers (test_kvbm_vllm.py), E/PD and
#                                                 E/P/D (test_multimodal_disagg.py), speculative decoding
#                                                 (test_speculative_vllm.py; TURBINE_TEST_SPEC_CONFIG picks the
#                                                 speculator, default n-gram), and the kvbm connector's check of a
#                                                 file block before it is offered against the host's vLLM
#                                                 (tests/unit/vllm/test_kvbm_offer_check.py); ARGS go to pytest (e.g. a -k)
#   bash benchmarks/gpu/gpu_tests.sh kv-tiers [ARGS]  benchmarks/kv_tiers/kv_tiers.py on the Llama-3.1-8B architecture (dummy
#                                                 weights), a working set several times the GPU cache
#   bash benchmarks/gpu/gpu_tests.sh serving [ARGS]   the serving matrix of issue #29 §5 (gpu_serving.py): --systems
#                                                 in alternating orders over several calls
#   bash benchmarks/gpu/gpu_tests.sh offload [ARGS]   benchmarks/gpu/gpu_serving.py: plain Turbine vs --connector kvbm
#                                                 (every block saved to the host tier) on decode-heavy load
#   bash benchmarks/gpu/gpu_tests.sh omni [ARGS]      issue #35 §2 (gpu_omni.py; needs `gpu_install.sh install-omni`): the omni
#                                                 worker's text pipeline against the plain worker, its text→image
#                                                 pipeline (PNGs, seeds, cancel), Turbine vs AsyncOmni called directly;
#                                                 --phase text / --phase image split it over two calls
#   bash benchmarks/gpu/gpu_tests.sh offer-check      what the kvbm connector's check of a file block before it is
#                                                 offered costs on this host (kvbm_offer_check.py: serial vs threaded)
# Two GPUs (issue #30):
#   bash benchmarks/gpu/gpu_tests.sh tp [ARGS]        tensor parallelism 2: `vllm serve`, a Turbine worker, and the same
#                                                 over two processes as nodes (leader + --headless): greedy parity,
#                                                 the card's KV vs vLLM's, decode-heavy throughput at C=256
#   bash benchmarks/gpu/gpu_tests.sh dp [ARGS]        data parallelism 2 (one worker; leader + headless node): spread,
#                                                 prefix landing, migration off a killed rank (gpu_parallel.py)
#   bash benchmarks/gpu/gpu_tests.sh moe [ARGS]       a small Mixtral MoE with expert parallelism (TP=2+EP, DP=2+EP)
#   bash benchmarks/gpu/gpu_tests.sh disagg-load [ARGS]  gpu_disagg.py load, strict KV: 1P1D vs 2 aggregated vs TP=2
#   bash benchmarks/gpu/gpu_tests.sh planner [ARGS]   issue #30 §3 (gpu_planner.py): the planner's disaggregated mode with
#                                                 the local connector (prefill on GPU 0, 1-2 decode workers on GPU 1,
#                                                 a sleeping pool of one) under a low-high-low-high-low ramp of
#                                                 streamed requests: none lost, a decode worker added and taken out
#                                                 (about 6 minutes: STEP_TIMEOUT=540)
#
# The tests share one GPU between their engines (several per module): TURBINE_TEST_VLLM_ARGS gives each a small
# memory budget. The embedded SmolLM2 comes from the bundle (converted by gpu_install.sh), found where
# `turbine model prepare` looks (TURBINE_CACHE).
set -uo pipefail
H8=${H8:-/tmp/h8}
OUT=${OUT:-/tmp/gpu-out}
HERE=$(cd "$(dirname "$0")/../.." && pwd)
cd "$HERE"
mkdir -p "$OUT"
# NCCL_NVLS_ENABLE=0: NVLink multicast stays off on the lent hosts (their KINDS notes).
export PYTHONPATH="$H8/site:$HERE" PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 NCCL_NVLS_ENABLE=0
export TURBINE_CACHE="$H8/cache"
mkdir -p "$TURBINE_CACHE/models"
ln -sfn "$H8/smollm2" "$TURBINE_CACHE/models/smollm2-135m-instruct"
touch "$H8/smollm2/.turbine-complete"
LLAMA="$H8/model-llama-3.1-8b"

# Tensor parallelism on the lent two-GPU host (a VM; NVLink multicast stays off, its KINDS notes). vLLM 0.26's
# defaults reach for multicast-backed collectives there, and each killed the engine in start-up with "an illegal
# memory access" (2026-11-29): the all-reduce through torch's symmetric memory (CUDASymmetricMemory), and, with it
# off, FlashInfer's fused all-reduce + RMSNorm on its "mnnvl" workspace (then CUBLAS_STATUS_INTERNAL_ERROR in the
# profile run). So every TP engine here (tp, disagg-load; `vllm serve` and Turbine alike) all-reduces through NCCL
# only: symmetric-memory all-reduce off, -O2's sequence parallelism / async TP (GEMMs fused with symmetric-memory
# collectives) and fused all-reduce + RMSNorm off, vLLM's custom (CUDA IPC) all-reduce off.
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_ALLREDUCE_USE_SYMM_MEM=${VLLM_ALLREDUCE_USE_SYMM_MEM:-0}
export VLLM_FLASHINFER_ALLREDUCE_BACKEND=${VLLM_FLASHINFER_ALLREDUCE_BACKEND:-trtllm}
NO_SYMM_PASSES='--compilation-config {"pass_config":{"enable_sp":false,"fuse_gemm_comms":false,"fuse_allreduce_rms":false}} --disable-custom-all-reduce'
# STEP_TIMEOUT=SECONDS bounds the step's Python (SIGTERM, then SIGKILL 30 s on): each script stops its servers and
# writes its results on SIGTERM. A `timeout` around this script instead would stop the shell only and leave the
# servers running into the next step (2026-11-29: a hung TP engine stayed on GPU 0 through the omni timing).
PY=(python3)
[ -n "${STEP_TIMEOUT:-}" ] && PY=(timeout -s TERM -k 30 "$STEP_TIMEOUT" python3)
step=${1:-}
shift || true
case "$step" in
  sweep)
    python3 scripts/import_sweep.py --out "$OUT/import_sweep.json"
    ;;
  tests)
    # --skip-mm-profiling: vLLM 0.26's encoder profiling fails on the tests' tiny Idefics3 (a dummy batch of
    # zero patches); it sizes the encoder cache's memory only.
    export TURBINE_TEST_VLLM_ARGS=${TURBINE_TEST_VLLM_ARGS:-"--gpu-memory-utilization 0.06 --kv-cache-memory-bytes 1073741824 --skip-mm-profiling"}
    # The test vision-language model with tiled pictures: vLLM 0.26 drops an unsplit picture (tests/multimodal_model.py).
    export TURBINE_TEST_VLM_TILES=${TURBINE_TEST_VLM_TILES:-1}
    "${PY[@]}" -m pytest -p no:cacheprovider -q -rA --durations=15 --junitxml="$OUT/gpu_tests.xml" \
      tests/integration/test_kvbm_vllm.py tests/integration/test_multimodal_disagg.py \
      tests/integration/test_speculative_vllm.py tests/unit/vllm/test_kvbm_offer_check.py tests/unit/vllm/test_kvbm_copy.py "$@" 2>&1 | tee "$OUT/gpu_tests.log"
    # The engines' own logs (a failed engine's traceback is only there), back with the results.
    find /tmp/pytest-of-*/ -name '*.log' -mmin -120 2>/dev/null | tar -czf "$OUT/gpu_test_logs.tgz" -T - 2>/dev/null || true
    ;;
  kv-tiers)
    # 16,384-token histories, 8 conversations: a 131k-token working set over a 2,048-block (32k-token) GPU cache.
    "${PY[@]}" -m benchmarks.kv_tiers.kv_tiers --python python3 --device gpu --model "$LLAMA" --served-model-name llama \
      --vocab 128000 --block-size 16 --engine-blocks 2048 --max-model-len 16800 --context-tokens 16384 \
      --conversations 8 --turns 3 --host-gb 20 --small-host-gb 2 --disk-gb 24 \
      --worker-args "--load-format dummy --gpu-memory-utilization 0.5" --run-dir /tmp/kv-tiers \
      --out "$OUT/kv_tiers_gpu.json" "$@" 2>&1 | tail -40
    ;;
  serving)
    # Issue #29 §5: offline (an engine per concurrency) vs `vllm serve` vs Turbine, both loads, C = 1, 64, 256, 512,
    # frontend processes 1, 2, 4 at C=512. One call's 600 s fits about two systems: run it twice or more with
    # --systems in alternating orders (e.g. serve,turbine then offline,turbine then offline,serve).
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} taskset -c 0-15 "${PY[@]}" -m benchmarks.gpu.gpu_serving run \
      --model "$LLAMA" --loads 128x512,1024x256 --concurrency 1,64,256,512 --frontend-processes 1,2,4 \
      --scaling-concurrency 512 --out "$OUT/gpu_serving.json" "$@" 2>&1 | tee "$OUT/gpu_serving.log" | grep -E '^\[' \
      | tail -40  # the whole log (the engines' own errors) comes back in gpu_serving.log
    ;;
  lifecycle)
    # Sleep / wake at levels 1 and 2, then checkpoint mode (quiesce by a level-1 sleep, restore-complete) on the
    # embedded SmolLM2 (level 2 needs real weights on disk): issues #20 and #34.
    "${PY[@]}" -m benchmarks.gpu.gpu_sleep_worker --model "$H8/smollm2" --cycles 1 --checkpoint \
      --engine-args "--gpu-memory-utilization 0.3" --out "$OUT/gpu_sleep_worker.json" "$@" 2>&1 | tail -30
    ;;
  profile)
    # Issue #29: why 2 and 4 frontend processes served prefill-heavy load at C=512 slower than one. Each server
    # process's cores per point, and py-spy's stacks of the worker's and frontends' processes (a py-spy wheel in
    # .whl/, carried).
    PYSPY=$(ls -d /tmp/pyspy/*.data/scripts/py-spy 2>/dev/null || (mkdir -p /tmp/pyspy && cd /tmp/pyspy &&
      python3 -m zipfile -e "$HERE"/.whl/py_spy-*.whl . && chmod +x ./*.data/scripts/py-spy && ls -d "$PWD"/*.data/scripts/py-spy))
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} taskset -c 0-15 "${PY[@]}" -m benchmarks.gpu.gpu_serving run \
      --model "$LLAMA" --systems turbine --loads 1024x256 --concurrency 512 --frontend-processes 1,2,4 \
      --scaling-concurrency 512 --py-spy "$PYSPY" --out "$OUT/gpu_profile.json" "$@" 2>&1 | grep -E '^\[' | tail -40
    ;;
  offer-check)
    # The kvbm connector's check of a file block before it is offered, on this host's disk and cores: serial vs
    # threaded, page cache warm and cold (benchmarks/kv_tiers/kvbm_offer_check.py; seconds).
    "${PY[@]}" -m benchmarks.kv_tiers.kvbm_offer_check --cold --dir /tmp --out "$OUT/kvbm_offer_check_gpu.json" "$@"
    ;;
  offload)
    "${PY[@]}" -m benchmarks.gpu.gpu_serving run --model "$LLAMA" --systems turbine,turbine-kvbm,turbine-kvbm,turbine \
      --loads 128x512 --concurrency 64 --max-num-seqs 64 --out "$OUT/kvbm_offload_gpu.json" "$@" 2>&1 | tail -30
    ;;
  tp)
    "${PY[@]}" -m benchmarks.gpu.gpu_serving run --model "$LLAMA" --tensor-parallel-size 2 --parity 8 \
      --systems serve,turbine,turbine-2nodes --loads 128x512 --concurrency 256 --engine-args="$NO_SYMM_PASSES" \
      --out "$OUT/gpu_tp2.json" "$@" 2>&1 | grep -E '^\[' | tail -40
    ;;
  dp)
    "${PY[@]}" -m benchmarks.gpu.gpu_parallel dp --model "$LLAMA" --out "$OUT/gpu_dp.json" "$@" 2>&1 | tail -60
    ;;
  moe)
    "${PY[@]}" -m benchmarks.gpu.gpu_parallel moe --tokenizer-from "$LLAMA" --out "$OUT/gpu_moe.json" "$@" 2>&1 | tail -40
    ;;
  disagg-load)
    "${PY[@]}" -m benchmarks.gpu.gpu_disagg load --model "$LLAMA" --load-format dummy --engine-args="$NO_SYMM_PASSES" \
      --out "$OUT/gpu_disagg_load.json" "$@" 2>&1 | grep -v '"logs"' | tail -40
    ;;
  planner)
    # The run's folder (planner, frontend and worker logs, the planner's config and profile) comes back under $OUT.
    "${PY[@]}" -m benchmarks.gpu.gpu_planner --model "$LLAMA" --load-format dummy --run-dir "$OUT/gpu_planner_run" \
      --out "$OUT/gpu_planner.json" "$@" 2>&1 | tee "$OUT/gpu_planner.log" | tail -80
    ;;
  omni)
    # vLLM-Omni's site first for this script (diffusers builds the tiny model); each process it starts gets its own
    # PYTHONPATH: vLLM-Omni's site only where vLLM-Omni runs (its vLLM plugin patches vLLM wherever it imports).
    PYTHONPATH="$H8/omni-site:$PYTHONPATH" "${PY[@]}" -m benchmarks.gpu.gpu_omni --llm "$H8/smollm2" \
      --site "$H8/site" --omni-site "$H8/omni-site" --out "$OUT/gpu_omni.json" --logs "$OUT/omni-logs" "$@" 2>&1 \
      | tee "$OUT/gpu_omni.log" | tail -150
    ;;
  *)
    echo "usage: gpu_tests.sh sweep | tests [pytest args] | kv-tiers [args] | serving [args] | profile [args] | lifecycle [args] | offload [args] | offer-check | tp | dp | moe | disagg-load | planner [args] | omni [args]" >&2
    exit 2
    ;;
esac
