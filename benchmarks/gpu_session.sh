#!/usr/bin/env bash
# Every GPU check and figure of issues 4 and 7, in parts that each fit one 10-minute device call, writing
# JSON reports and logs under $OUT (default ./gpu_out). Run from the repository root on the GPU machine:
#
#   bash benchmarks/gpu_session.sh kernels   # GPU tests of the Triton kernels and attention layers (-m gpu)
#   bash benchmarks/gpu_session.sh tests     # the other GPU tests: runner, models, quantization, engine, ...
#   bash benchmarks/gpu_session.sh latency   # batch-1 decode and TTFT: bf16, fp8, int8, int4, 14b, 2048 tokens
#   bash benchmarks/gpu_session.sh long      # 32k context with bf16 and fp8 KV caches, startup time
#   bash benchmarks/gpu_session.sh tput      # workload 3 in bf16 and fp8, host overhead at batch 256
#   bash benchmarks/gpu_session.sh models    # greedy tokens and logits against transformers at 7b shapes, per mode
#   bash benchmarks/gpu_session.sh attn      # attention kernels: decode bf16 vs fp8 cache (+ sweep), prefill vs SDPA
#   bash benchmarks/gpu_session.sh profile   # where time goes: 2048-token TTFT, batch-1 step, fp8 workload 3,
#                                            # fp8 GEMM accumulation modes, fp8 GEMMs at 17 <= M <= 256
#   bash benchmarks/gpu_session.sh decode8   # 8-bit / 4-bit decode: the W8A8 / int4 kernel tests, the wide
#                                            # W8A8 sweep, batch 1 per mode
#   bash benchmarks/gpu_session.sh int4      # the int4 GEMV tests, the f16x2 launch-shape sweep, int4 batch 1
#   bash benchmarks/gpu_session.sh order     # decode rows longest context first (`LONGEST_FIRST`, the default):
#                                            # the graph and decode tests, workload 3 in bf16 and fp8 with it and
#                                            # without
#   bash benchmarks/gpu_session.sh rope      # RoPE fused into the KV write (`FUSE_ROPE`, on): its GPU
#                                            # tests, batch 1 (bf16, int4) and the 2048-token TTFT with it and
#                                            # without
#   bash benchmarks/gpu_session.sh w3prof    # where workload 3's time goes, bf16 and fp8 (synchronous steps,
#                                            # kernel tables of a prefill and a decode step)
#   bash benchmarks/gpu_session.sh gaps      # workload 3 with async scheduling, bf16 and fp8: the GPU's idle time
#                                            # between steps, and the host's time by phase
#   bash benchmarks/gpu_session.sh defer     # decoding deferred to the end for `generate`'s final-only outputs:
#                                            # workload 3 in bf16 with it and without, the gaps, fp8
#   bash benchmarks/gpu_session.sh pairs     # int4 batch 1 with the norms and SiLU writing the f16x2 GEMV's
#                                            # activation pairs (`paired_input`, on): its GPU tests, batch 1
#                                            # with it and without
#   bash benchmarks/gpu_session.sh fused33   # int4 batch 1's fusions of the 33rd session (SiLU-and-mul
#                                            # in the gate/up GEMV, on since the 35th; the o norm in
#                                            # its GEMV's tail, on since the 36th): tests, greedy; fused33ab: batch 1
#                                            # with each; normedfix: the o norm after its pairs' fix;
#                                            # fused33bf16: bf16 batch 1 with the gated gate/up GEMM;
#                                            # fused33quick: one short call, LIMIT seconds (default
#                                            # 480): batch 1 with none / all / gated / normed
#                                            # (VARIANTS), then the fusions' GPU tests
#   bash benchmarks/gpu_session.sh pdl36     # int4 batch 1 with the QKV and o GEMVs' weights loaded while
#                                            # the norm / attention before them runs (programmatic
#                                            # dependent launch, `pdl_preload`, on): tests, the A/B
#                                            # against QWICK_PDL=0, greedy, the graph tests
#   bash benchmarks/gpu_session.sh pdlmlp    # the early-launched chain (`pdl_mlp`: o lets gate/up in;
#                                            # `pdl_down`: gate/up lets down in, both on since the
#                                            # 47th; `pdl_norm`: down lets the norm in, QKV attention,
#                                            # on): int4 batch 1 with none / PDL off / norm / both /
#                                            # all, tests
#   bash benchmarks/gpu_session.sh attnpreload  # a lone decode row's attention loading its first key tile
#                                            # before it waits for QKV (`DECODE_PRELOAD`), QKV letting it
#                                            # in at its start (`pdl_qkv_start`), o let in after the wait
#                                            # (`DECODE_TRIGGER_LATE`), all on since the 40th: tests,
#                                            # int4 and fp8 batch 1 with each added, round-robin
#   bash benchmarks/gpu_session.sh gemvncu   # (alone in its call: the report must come back) the batch-1
#                                            # GEMVs under Nsight Compute (W8A8 down against
#                                            # gate/up: why down streams slower)
#   bash benchmarks/gpu_session.sh half2sass # the f16x2 int4 GEMV's stalls per SASS instruction (ncu)
#   bash benchmarks/gpu_session.sh widetiles # the f16x2 int4 GEMV in 64-word tiles against 32
#   bash benchmarks/gpu_session.sh fusedsweep # one decode row's W8A8 MLP in one launch (the prototype,
#                                            # benchmarks/fused_mlp_w8.py) against the three launches
#   bash benchmarks/gpu_session.sh gatedmlp  # SiLU-and-mul in the W8A8 gate/up GEMV, its tail writing
#                                            # the down projection's codes (on for int8): tests, fp8 /
#                                            # int8 batch 1 as they are and flipped (REPS_LIST)
#   bash benchmarks/gpu_session.sh gatedprof # the batch-1 step's critical path, fp8 and int8, with it
#                                            # off and on (why fp8 loses)
#   bash benchmarks/gpu_session.sh normw     # RMSNorm reading its weight with x, not after the row's sum
#                                            # (`NORM_WEIGHT_WITH_X`, on: int4 +0.5% on an H100): tests, fp8 /
#                                            # int8 / int4 batch 1 with it and without, alternating
#   bash benchmarks/gpu_session.sh short512  # a lone row's one-split graph up to 512 tokens (on) against
#                                            # 256: the graph tests, fp8 and int4 batch 1 at 384 + 128
#                                            # tokens, alternating
#   bash benchmarks/gpu_session.sh newkey    # a lone decode row scoring the new key apart from its
#                                            # preloaded tile (`DECODE_NEW_KEY_APART`, on since
#                                            # the 45th session): tests, fp8 / int4 batch 1 default
#                                            # and flipped, alternating
#   bash benchmarks/gpu_session.sh int4mlp   # int4 batch 1 with its MLP chain launched early (the default
#                                            # since the 47th session) and without, alternating
#   bash benchmarks/gpu_session.sh preloadtile  # a lone decode row reading its short context whole
#                                            # before its wait (256-key tiles, `DECODE_PRELOAD_TILE`, on
#                                            # since the 42nd): tests, fp8 / int8 / int4 batch 1 with it and
#                                            # with the 128-key tiles, alternating
#   bash benchmarks/gpu_session.sh targets   # issue 7's batch-1 table in one short call (bf16, fp8, int8,
#                                            # int4), then int4 with its MLP chain (`pdl_mlp`, `pdl_down`)
#                                            # and without, alternating: for an H200
#   bash benchmarks/gpu_session.sh b1modes   # that table alone (four runs, ~2.5 minutes)
#   bash benchmarks/gpu_session.sh w8chain   # the W8A8 GEMVs of one decode row launched early, the norms
#                                            # and attention after them too (`W8A8LinearMethod.pdl_norm`,
#                                            # on since the 39th session): tests, fp8 and int8 batch 1 with
#                                            # it off and on, alternating, greedy (W8CHAIN_AB_ONLY=1: tests
#                                            # and timing)
#   bash benchmarks/gpu_session.sh fp8pdl    # the fp8 o row GEMV launched early after attention, its
#                                            # first tiles preloaded (`pdl_preload`, off): tests, fp8
#                                            # batch 1 with it and without, greedy
#   bash benchmarks/gpu_session.sh int8pdl   # int8's o on that early-launched row GEMV, against the default
#   bash benchmarks/gpu_session.sh int4diag  # what limits the int4 GEMV: its tiling built up stage by stage
#   bash benchmarks/gpu_session.sh int4shapes  # int4 batch 1 with the two per-shape launches (o 64 rows x
#                                            # 8 warps, down 2 warps with the prefetch; the default since
#                                            # the 32nd session) and with the 31st's rule, alternating
#   bash benchmarks/gpu_session.sh int8row   # int8 batch 1 with its o row on the row GEMV (with the
#                                            # prefetch) patched in, and without, alternating (32nd
#                                            # session: 372.9 / 372.6 against 372.3 / 372.1, not kept)
#   bash benchmarks/gpu_session.sh w8row     # one fp8 o-projection row through the CUDA-core row GEMV
#                                            # (`row_gemv_max_n`, on): its GPU tests, fp8 batch 1 with it
#                                            # and without, alternating
#   bash benchmarks/gpu_session.sh tiles32   # the f16x2 GEMV's 32-row tiles (the default since the 31st
#                                            # session) against 64-row ones: its GPU tests, int4 batch 1
#                                            # with each, alternating
#                                            # (loads, scales, activations, decoding) beside a copy
#   bash benchmarks/gpu_session.sh kvlayout  # head-major KV pages (HND) against NHD: tests/layers (both),
#                                            # the attention bench in both, workload 3 and 32k with HND
#   bash benchmarks/gpu_session.sh outrows_w3  # workload 3 with it and without, ABBA in one process
#                                            # (fp8, bf16), and the host's time in the eager steps
#   bash benchmarks/gpu_session.sh hfrows    # transformers beside batch 1 at 8k and 32k context and startup
#   bash benchmarks/gpu_session.sh longprefill  # prefill chunks of 4096+ queries pipelined deeper: tests,
#                                            # the 32k and 8k TTFT with it and without
#   bash benchmarks/gpu_session.sh next      # kernel and layer GPU tests after the twelfth session's kernel
#                                            # changes; next2: greedy tokens with an fp32 yardstick, the sweep
#   bash benchmarks/gpu_session.sh shortgraphs  # one-split decode graphs for short contexts (on): tests,
#                                            # batch 1 (bf16, int4) with them and without
#   bash benchmarks/gpu_session.sh headdefault  # the 8-bit modes with their head quantized (the default):
#                                            # batch 1 bf16 / fp8 / int8, workload 3 bf16 / fp8
#   bash benchmarks/gpu_session.sh int4head  # int4's LM head in int8 (the default) against bf16 and int4
#                                            # heads: its GPU tests, batch 1 with each
#   bash benchmarks/gpu_session.sh shortdecode  # one-row decode attention at short contexts: a launch-
#                                            # shape sweep, int4 batch 1 with the fastest shape and without
#   bash benchmarks/gpu_session.sh int4mid   # int4 at 17+ rows: the tiled W4A16 kernel's tests, layer
#                                            # sweep; int4mid_e2e: 64 concurrent requests and the
#                                            # 128-token TTFT with it and without
#   bash benchmarks/gpu_session.sh int4tiles # the tiled kernel's variants at 2-128 rows
#   bash benchmarks/gpu_session.sh int4small_e2e  # 8 and 16 concurrent requests, 2-16 rows tiled or not
#   bash benchmarks/gpu_session.sh int4half  # fp16 models: the tiled kernel's packed fp16 decode, on or off
#   bash benchmarks/gpu_session.sh int4models  # int4 greedy/logits vs transformers, 8-row decode steps
#   bash benchmarks/gpu_session.sh prefillgraphs  # lone prompts through the prefill CUDA graphs: tests,
#                                            # TTFT with them and without (bf16, int4, fp8), batch 1
#   bash benchmarks/gpu_session.sh mixedsplit  # decode rows + one prompt chunk as two graph replays:
#                                            # its GPU test, TTFT beside 8 / 64 decoders, split or eager
#   bash benchmarks/gpu_session.sh decodewrite  # the decode kernel writing the new keys and values:
#                                            # tests, batch 1 with it and without
#   bash benchmarks/gpu_session.sh int4_14b  # the tiled int4 kernel's shapes on qwen2.5-14b's layers
#   bash benchmarks/gpu_session.sh int4_14b_e2e  # the launch shapes 14b's sweep added: tests, the sweep,
#                                            # 32 / 64 concurrent 14b int4 requests with them and without
#   bash benchmarks/gpu_session.sh rowquant  # launch shapes of the kernels writing fp8 codes above 16 rows,
#                                            # fp8 workload 3 with the fastest and without
#   bash benchmarks/gpu_session.sh rowquant_e2e  # with those as defaults: tests, the sweep at 64 / 256
#                                            # rows, workload 3 bf16 and fp8 (twice)
#   bash benchmarks/gpu_session.sh next22    # the sampling race on 8 programs per SM (was 2) and SiLU's
#                                            # codes from registers: GPU tests, both sweeps, workload 3
#                                            # fp8 new / old / new and bf16, fp8 down at 136-160 rows
#   bash benchmarks/gpu_session.sh tma       # the fp8 split-K GEMM through TMA: tests, the down projection
#                                            # at 128-256 rows against cuBLAS
#   bash benchmarks/gpu_session.sh graphrows  # prefill graphs of up to 4 rows (a prompt beside decoders)
#   bash benchmarks/gpu_session.sh graphrows4  # with 4 rows the default: tests, batch 1 with 4 and 1 rows
#   bash benchmarks/gpu_session.sh roundto   # rotary products rounded in PTX: exactness tests, fp8 graphs
#                                            # (the fused decode write on, the default, and off)
#   bash benchmarks/gpu_session.sh int4ttft  # int4 short-prompt TTFT, 65-128 rows tiled or not (one process)
#   PART=1|2 bash benchmarks/gpu_session.sh int4pipe_e2e  # the pipelined tiled kernel at 2-128 rows:
#                                            # tests, 8-128 concurrent requests with it and without
#   bash benchmarks/gpu_session.sh w3kv      # workload 3: bf16, fp8, fp8 with an fp8 KV cache
#   bash benchmarks/gpu_session.sh lmhead    # the LM head quantized too (`--quantize-lm-head`): its
#                                            # GPU tests, batch 1 per mode with it and without, fp8 workload 3
#   bash benchmarks/gpu_session.sh outrows   # the last layer run only for the sampling tokens
#                                            # (`ModelRunner.sampled_rows_only`, on): its GPU tests, the
#                                            # 2048-token TTFT and workload 3 with it and without, greedy
#                                            # tokens against transformers, TTFT beside transformers
#
# On the project's device machine, install the wheels the server side needs first (carry .whl along).
# The device has no registry; download them here for its Python 3.12 (xgrammar needs apache-tvm-ffi and
# pydantic, or the grammar tests skip there; the engine and structured-output tests need pyzmq and
# jsonschema):
#   pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --no-deps \
#     msgspec tqdm xgrammar apache-tvm-ffi gguf pydantic pydantic-core annotated-types typing-inspection \
#     typing-extensions pyzmq jsonschema jsonschema-specifications referencing rpds-py attrs -d .whl
#   python -m pip install -q --no-deps .whl/*.whl
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
CLI="python -m qwick.entrypoints.cli"
LAT="$CLI bench latency --num-iters 3"
SHORT="--max-model-len 4096 --input-len 128 --output-len 128"
TPUT="$CLI bench throughput --shape qwen2.5-7b --max-model-len 4096 --num-prompts 256 \
  --input-len-range 100 1024 --output-len-range 100 1024 --num-iters 1"

# The qwick command line with every token through the model's last layer (`sampled_rows_only` off), for
# A/B runs: python -c "$ALL" bench ...
ALL="import sys; from qwick.runner.model_runner import ModelRunner as R; i = R.__init__; \
R.__init__ = lambda s, *a, **k: (i(s, *a, **k), setattr(s, 'sampled_rows_only', False))[0]; \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"

run() {  # name, command...: log the command and its output to $OUT/name.log, print the name and figures
  # (not the command: a device call returns only its output's last 12,000 characters) and add them to
  # $OUT/00_summary.txt (a device call brings back 8 files, and this one sorts first)
  local name=$1
  shift
  echo "== $name"
  local rc line
  { echo "\$ $*"; "$@"; } >"$OUT/$name.log" 2>&1
  rc=$?
  line="   exit $rc $(grep -ho '"\(decode_tokens_per_s\|ttft_ms\|output_tokens_per_s\)": [0-9.]*' "$OUT/$name.log" \
    | head -3 | tr '\n' ' ')"
  echo "$line"
  echo "$name $line" >>"$OUT/00_summary.txt"
}

alternate() {  # name_a name_b patch args...: the CLI with args as it is (a) and with the python patch (b),
  # alternating, REPS_LIST (default "1 2") times each
  local a=$1 b=$2 patch=$3
  shift 3
  for i in ${REPS_LIST:-1 2}; do
    run "${a}_$i" $CLI "$@" --output-json "$OUT/${a}_$i.json"
    run "${b}_$i" python -c "$patch" "$@" --output-json "$OUT/${b}_$i.json"
  done
}

case "${1:-}" in
  kernels)
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/layers 2>&1 | tail -15
    ;;
  tests)
    python -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors tests \
      --ignore=tests/kernels --ignore=tests/layers 2>&1 \
      | tail -15
    python -m pytest -q -p no:cacheprovider tests/entrypoints/test_llm_structured.py 2>&1 | tail -3
    ;;
  targets)  # issue 7's batch-1 decode table (`b1modes`), then int4 with its MLP chain and without
    # (`int4mlp`)
    bash "$0" b1modes
    bash "$0" int4mlp
    ;;
  b1modes)  # issue 7's batch-1 decode table: bf16, fp8, int8 and int4, one run each
    run bf16 $LAT --shape qwen2.5-7b $SHORT --output-json "$OUT/lat_bf16.json"
    for q in fp8 int8 int4; do
      run "$q" $LAT --shape qwen2.5-7b $SHORT --quantization "$q" --output-json "$OUT/lat_$q.json"
    done
    ;;
  int4mlp)  # int4's MLP chain (`pdl_mlp` and `pdl_down`: on since the 47th session, +2.5-2.7% on an H100)
    # against the defaults without it, alternating (REPS_LIST)
    OFF="import sys; from qwick.quantization.int4 import PackedLinearMethod as P; P.pdl_mlp = P.pdl_down = False
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    alternate b1_int4_default b1_int4_mlp_off "$OFF" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT \
      --quantization int4
    ;;
  latency)
    run bf16 $LAT --shape qwen2.5-7b $SHORT --output-json "$OUT/lat_bf16.json"
    run bf16_sync $LAT --shape qwen2.5-7b $SHORT --no-async-scheduling --output-json "$OUT/lat_bf16_sync.json"
    for q in fp8 int8 int4; do
      run "$q" $LAT --shape qwen2.5-7b $SHORT --quantization "$q" --output-json "$OUT/lat_$q.json"
    done
    run 14b $LAT --shape qwen2.5-14b $SHORT --output-json "$OUT/lat_14b.json"
    run ttft2048 $LAT --shape qwen2.5-7b --max-model-len 4096 --input-len 2048 --output-len 2 \
      --output-json "$OUT/ttft2048.json"
    ;;
  long)
    for kv in auto fp8; do
      run "ctx32k_$kv" $CLI bench latency --num-iters 2 --shape qwen2.5-7b --max-model-len 32768 \
        --input-len 32000 --output-len 64 --kv-cache-dtype "$kv" --output-json "$OUT/ctx32k_$kv.json"
    done
    run ctx8k $CLI bench latency --num-iters 2 --shape qwen2.5-7b --max-model-len 32768 --input-len 8192 \
      --output-len 64 --output-json "$OUT/ctx8k.json"
    run startup python benchmarks/startup_time.py qwen2.5-7b 32768
    tail -3 "$OUT/startup.log"
    ;;
  tput)
    run tput_bf16 $TPUT --output-json "$OUT/tput_bf16.json"
    run tput_fp8 $TPUT --quantization fp8 --output-json "$OUT/tput_fp8.json"
    run host python benchmarks/host_overhead.py --shape qwen2.5-7b --steps 20 --profile-steps 0
    tail -12 "$OUT/host.log"
    ;;
  models)
    for q in "" fp8 int8 int4; do
      echo "== ${q:-bf16}"
      python benchmarks/greedy_vs_transformers.py $q 2>&1 | grep -E "^(quantization|prompt)" | tee -a "$OUT/models.log"
    done
    ;;
  attn)
    ATT="python -m qwick.bench.attention_bench --batch 1 8 256 --context 640 32768 --no-torch"
    $ATT --prefill --sweep --json "$OUT/attn_bf16.json" 2>&1 | tail -45
    $ATT --kv-cache-dtype fp8 --sweep --json "$OUT/attn_fp8.json" 2>&1 | tail -30
    ;;
  profile)
    python benchmarks/ttft_profile.py qwen2.5-7b 2048 >"$OUT/ttft_profile.log" 2>&1
    grep TTFT "$OUT/ttft_profile.log"
    python benchmarks/decode_step_profile.py >"$OUT/decode_step_profile.log" 2>&1
    grep -E "median|replay|compute_logits|bs " "$OUT/decode_step_profile.log"
    python benchmarks/throughput_profile.py qwen2.5-7b fp8 >"$OUT/tprof_fp8.log" 2>&1
    tail -16 "$OUT/tprof_fp8.log"
    python benchmarks/fp8_scaled_mm.py 2>&1 | tee "$OUT/fp8_scaled_mm.log"
    python benchmarks/fp8_mid_m_sweep.py 7b 2>&1 | grep -v skip | tee "$OUT/fp8_mid_m_sweep.log"
    ;;
  decode8)
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w8a8_kernels.py tests/kernels/test_row_gemv.py \
      tests/kernels/test_elementwise.py tests/quantization/test_w8a8_gpu.py \
      tests/quantization/test_w8a8_layer.py 2>&1 | tail -3
    python benchmarks/decode_quant_kernels.py 2>&1 | tee "$OUT/decode_quant_kernels.log" | tail -4
    MS=1 WIDE=1 SAMPLE=24 BUDGET_S=150 python benchmarks/w8a8_gemv_sweep.py "$OUT/w8a8_wide.json" 2>&1 \
      | grep -E "^(gate|down|qkv|o )"
    for q in fp8 int8 int4; do
      run "$q" $LAT --shape qwen2.5-7b $SHORT --quantization "$q" --output-json "$OUT/lat_$q.json"
    done
    ;;
  kvlayout)
    python -m pytest -q -m gpu -p no:cacheprovider tests/layers 2>&1 \
      | tail -2
    for layout in NHD HND; do
      python -m qwick.bench.attention_bench --no-torch --batch 1 64 256 --context 640 8192 32768 --prefill \
        --kv-layout $layout --json "$OUT/attn_$layout.json" 2>&1 | tail -14
    done
    HND="import sys; from qwick.layers.attention.triton_backend import TritonAttentionBackend as T; \
T.kv_layout = 'HND'; from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    run tput_bf16_hnd python -c "$HND" ${TPUT#python -m qwick.entrypoints.cli } --output-json "$OUT/tput_hnd.json"
    run tput_bf16 $TPUT --output-json "$OUT/tput_bf16.json"
    run ctx32k_hnd python -c "$HND" bench latency --num-iters 2 --shape qwen2.5-7b --max-model-len 32768 \
      --input-len 32000 --output-len 64 --output-json "$OUT/ctx32k_hnd.json"
    ;;
  int4)
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_row_gemv.py \
      tests/quantization/test_int4_on_the_fly.py 2>&1 | tail -2
    python benchmarks/int4_half2_sweep.py "$OUT/int4_half2_sweep.json" 2>&1 | tee "$OUT/int4_half2_sweep.log" \
      | grep -v skipped | tail -18
    run int4 $LAT --shape qwen2.5-7b $SHORT --quantization int4 --output-json "$OUT/lat_int4.json"
    ;;
  order)
    python -m pytest -q -m gpu -p no:cacheprovider tests/runner/test_cuda_graphs.py tests/layers/test_triton_attention.py \
      -k "graphs or decode" 2>&1 | tail -2
    ROWS="import sys; import qwick.layers.attention.triton_backend as t; t.LONGEST_FIRST = False; \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    run tput_bf16 $TPUT --output-json "$OUT/tput_bf16.json"
    run tput_bf16_row_order python -c "$ROWS" ${TPUT#python -m qwick.entrypoints.cli } \
      --output-json "$OUT/tput_bf16_row_order.json"
    run tput_fp8 $TPUT --quantization fp8 --output-json "$OUT/tput_fp8.json"
    run tput_fp8_row_order python -c "$ROWS" ${TPUT#python -m qwick.entrypoints.cli } --quantization fp8 \
      --output-json "$OUT/tput_fp8_row_order.json"
    ;;
  rope)
    python -m pytest -q -m gpu -p no:cacheprovider tests/layers/test_triton_attention.py tests/kernels/test_elementwise.py \
      tests/runner/test_cuda_graphs.py -k "rope or graph or greedy or extend or decode_rows" 2>&1 | tail -2
    APART="import sys; import qwick.layers.attention.triton_backend as t; t.FUSE_ROPE = False; \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    for q in bf16 int4; do
      QA=$([ $q = int4 ] && echo "--quantization int4")
      run "lat_$q" $LAT --shape qwen2.5-7b $SHORT $QA --output-json "$OUT/lat_$q.json"
      run "lat_${q}_rope_apart" python -c "$APART" ${LAT#python -m qwick.entrypoints.cli } --shape qwen2.5-7b \
        $SHORT $QA --output-json "$OUT/lat_${q}_rope_apart.json"
    done
    TTFT="--shape qwen2.5-7b --max-model-len 4096 --input-len 2048 --output-len 2 --num-iters 7"
    run ttft2048 $CLI bench latency $TTFT --output-json "$OUT/ttft2048.json"
    run ttft2048_rope_apart python -c "$APART" bench latency $TTFT --output-json "$OUT/ttft2048_rope_apart.json"
    ;;
  w3prof)
    for q in bf16 fp8; do
      mkdir -p "$OUT/w3_$q"
      OUT="$OUT/w3_$q" timeout 280 python benchmarks/throughput_profile.py qwen2.5-7b \
        $([ $q = fp8 ] && echo fp8) >"$OUT/w3prof_$q.log" 2>&1
      tail -16 "$OUT/w3prof_$q.log"
    done
    ;;
  gaps)
    for q in ${QUANTS:-bf16 fp8}; do
      timeout 200 python benchmarks/throughput_gaps.py qwen2.5-7b $([ $q = bf16 ] || echo $q) \
        >"$OUT/gaps_$q.log" 2>&1
      mv -f throughput_gaps.json "$OUT/gaps_$q.json" 2>/dev/null
      tail -32 "$OUT/gaps_$q.log"
    done
    ;;
  defer)
    python -m pytest -q -m gpu -p no:cacheprovider tests/layers/test_triton_attention.py \
      tests/engine/test_async_scheduling.py -k "rope or async" 2>&1 | tail -2
    NODEFER="import sys; import qwick.engine.detokenizer as d; i = d.IncrementalDetokenizer.__init__; \
d.IncrementalDetokenizer.__init__ = lambda s, *a, defer=False, **k: i(s, *a, **k); \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    run tput_bf16 timeout 150 $TPUT --output-json "$OUT/tput_bf16.json"
    run tput_bf16_nodefer timeout 150 python -c "$NODEFER" ${TPUT#python -m qwick.entrypoints.cli } \
      --output-json "$OUT/tput_bf16_nodefer.json"
    run tput_fp8 timeout 150 $TPUT --quantization fp8 --output-json "$OUT/tput_fp8.json"
    QUANTS=bf16 bash "$0" gaps | grep -A8 '"seconds"\|traced_window'
    ;;
  pairs)
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_row_gemv.py tests/kernels/test_elementwise.py \
      tests/quantization/test_int4_on_the_fly.py -k "pairs or paired or f16x2 or nibble or row_gemv" 2>&1 | tail -2
    UNPAIRED="import sys; from qwick.quantization.int4 import PackedLinearMethod as P; P.paired_input = False; \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    for i in 1 2; do
      run "lat_int4_$i" $LAT --shape qwen2.5-7b $SHORT --quantization int4 --output-json "$OUT/lat_int4_$i.json"
      run "lat_int4_unpaired_$i" python -c "$UNPAIRED" ${LAT#python -m qwick.entrypoints.cli } --shape qwen2.5-7b \
        $SHORT --quantization int4 --output-json "$OUT/lat_int4_unpaired_$i.json"
    done
    ;;
  outrows)
    python -m pytest -q -m gpu -p no:cacheprovider tests/layers/attention/test_output_rows.py \
      tests/runner/test_no_compiles_while_serving.py tests/runner/test_cuda_graphs.py tests/models 2>&1 | tail -3
    TTFT="--shape qwen2.5-7b --max-model-len 4096 --input-len 2048 --output-len 2 --num-iters 7"
    for i in 1 2; do
      run "ttft2048_$i" $CLI bench latency $TTFT --output-json "$OUT/ttft2048_$i.json"
      run "ttft2048_all_rows_$i" python -c "$ALL" bench latency $TTFT --output-json "$OUT/ttft2048_all_$i.json"
    done
    run tput_bf16 $TPUT --output-json "$OUT/tput_bf16.json"
    run tput_bf16_all_rows python -c "$ALL" ${TPUT#python -m qwick.entrypoints.cli } \
      --output-json "$OUT/tput_bf16_all_rows.json"
    python benchmarks/greedy_vs_transformers.py 2>&1 | grep -E "^(quantization|prompt)" | tee "$OUT/models.log"
    run ttft2048_vs_hf $CLI bench latency --num-iters 3 --shape qwen2.5-7b --max-model-len 4096 --input-len 2048 \
      --output-len 2 --gpu-memory-utilization 0.5 --compare-transformers --output-json "$OUT/ttft2048_vs_hf.json"
    grep -A4 '"transformers"' "$OUT/ttft2048_vs_hf.json" | head -5
    ;;
  outrows_ab)  # the same, repeated: greedy tokens with it and without, workload 3 alternating
    ALL_ROWS=1 python benchmarks/greedy_vs_transformers.py 2>&1 | grep -E "^(quantization|prompt)" \
      | tee "$OUT/models.log"
    for q in bf16 bf16 fp8; do
      QA=$([ $q = fp8 ] && echo "--quantization fp8")
      run "tput_$q" $TPUT $QA --output-json "$OUT/tput_$q.json"
      run "tput_${q}_all_rows" python -c "$ALL" ${TPUT#python -m qwick.entrypoints.cli } $QA \
        --output-json "$OUT/tput_${q}_all_rows.json"
    done
    ;;
  outrows_fix)  # after the decode split-scratch strides stopped being specialized: no compiles while
    # serving, batch 1, the TTFT and workload 3 with it and without
    python -m pytest -q -m gpu -p no:cacheprovider tests/runner/test_no_compiles_while_serving.py \
      tests/runner/test_cuda_graphs.py tests/layers/attention/test_output_rows.py \
      tests/layers/test_triton_attention.py -k "not extend" 2>&1 | tail -2
    timeout 150 python benchmarks/compile_events.py qwen2.5-7b 2>&1 | grep -E "^(startup|batch|workload)"
    run bf16 $LAT --shape qwen2.5-7b $SHORT --output-json "$OUT/lat_bf16.json"
    run ttft2048 $CLI bench latency --num-iters 7 --shape qwen2.5-7b --max-model-len 4096 --input-len 2048 \
      --output-len 2 --output-json "$OUT/ttft2048.json"
    for q in bf16 fp8; do
      QA=$([ $q = fp8 ] && echo "--quantization fp8")
      run "tput_$q" $TPUT $QA --output-json "$OUT/tput_$q.json"
      run "tput_${q}_all_rows" python -c "$ALL" ${TPUT#python -m qwick.entrypoints.cli } $QA \
        --output-json "$OUT/tput_${q}_all_rows.json"
    done
    ;;
  outrows_rev)  # the same A/B in the other order (without first), then workload 3 beside transformers
    TTFT="--shape qwen2.5-7b --max-model-len 4096 --input-len 2048 --output-len 2 --num-iters 7"
    run ttft2048_all_rows python -c "$ALL" bench latency $TTFT --output-json "$OUT/ttft2048_all.json"
    run ttft2048 $CLI bench latency $TTFT --output-json "$OUT/ttft2048.json"
    for q in fp8 bf16; do
      QA=$([ $q = fp8 ] && echo "--quantization fp8")
      run "tput_${q}_all_rows" python -c "$ALL" ${TPUT#python -m qwick.entrypoints.cli } $QA \
        --output-json "$OUT/tput_${q}_all_rows.json"
      run "tput_$q" $TPUT $QA --output-json "$OUT/tput_$q.json"
    done
    bash "$0" w3hf
    ;;
  outrows_w3)  # workload 3 with the last layer for the sampling rows only and without, ABBA in one process
    for q in fp8 bf16; do
      timeout 280 python benchmarks/output_rows_ab.py qwen2.5-7b $([ $q = fp8 ] && echo "--quantization fp8") \
        --pairs 3 --out "$OUT/output_rows_ab_$q.json" 2>&1 | grep -E "^(run|sampling|every)"
    done
    ;;
  w3hf)  # workload 3 beside transformers' static batch (qwick at 0.35 of the memory so both fit)
    run tput_bf16_vs_hf $TPUT --gpu-memory-utilization 0.35 --compare-transformers \
      --output-json "$OUT/tput_bf16_vs_hf.json"
    grep -A4 '"transformers"' "$OUT/tput_bf16_vs_hf.json" | head -5
    ;;
  hfrows)  # transformers beside the rows that had none: batch 1 at 8k and 32k context, startup to ready
    for len in 8192 32000; do
      run "ctx${len}_vs_hf" $CLI bench latency --num-iters 2 --shape qwen2.5-7b --max-model-len 32768 \
        --input-len $len --output-len 64 --gpu-memory-utilization 0.5 --compare-transformers \
        --output-json "$OUT/ctx${len}_vs_hf.json"
      grep -A4 '"transformers"' "$OUT/ctx${len}_vs_hf.json" | head -5
    done
    python benchmarks/startup_time.py qwen2.5-7b 32768 --compare-transformers 2>&1 | grep "to ready"
    ;;
  longprefill)  # a third pipeline stage for prefill chunks of 4096+ queries: its GPU tests, the 32k and
    # 8k TTFT with it and without (alternating)
    python -m pytest -q -m gpu -p no:cacheprovider tests/layers/test_triton_attention.py -k "long_prefill or \
      extend_rows or chunked" tests/runner/test_no_compiles_while_serving.py 2>&1 | tail -2
    OFF="import sys, qwick.layers.attention.triton_backend as T; T.LONG_PREFILL_QUERIES = 1 << 30; \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    for len in 32000 8192; do
      A="bench latency --num-iters 3 --shape qwen2.5-7b --max-model-len 32768 --input-len $len --output-len 2"
      run "ttft${len}_on" $CLI $A --output-json "$OUT/ttft${len}_on.json"
      run "ttft${len}_off" python -c "$OFF" $A --output-json "$OUT/ttft${len}_off.json"
      run "ttft${len}_on2" $CLI $A --output-json "$OUT/ttft${len}_on2.json"
    done
    ;;
  next)  # after the twelfth session: every kernel and layer GPU test (the extend kernel's FMA change
    # and paged addressing, the fp8 query conversion, the PTX paths), then `next2`
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/layers 2>&1 | tail -3
    ;;
  next2)  # greedy tokens with the fp32 yardstick, the extend launch-shape sweep
    python benchmarks/greedy_vs_transformers.py 2>&1 | grep -E "^(quantization|prompt)" | tee "$OUT/models.log"
    SWEEP=1 python benchmarks/extend_prefix_probe.py 2>&1 | tail -11
    ;;
  shortgraphs)  # one-split decode graphs for contexts <= 256 tokens (`SHORT_CONTEXT_GRAPHS`): the graph
    # and no-compile tests, then batch 1 with them and without, alternating
    python -m pytest -q -m gpu -p no:cacheprovider tests/runner/test_cuda_graphs.py \
      tests/runner/test_no_compiles_while_serving.py 2>&1 | tail -2
    SG="import sys, qwick.runner.cuda_graphs as C; C.SHORT_CONTEXT_GRAPHS = 0; \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    B1="bench latency --num-iters 3 --shape qwen2.5-7b $SHORT"
    run b1_short $CLI $B1 --output-json "$OUT/b1_short.json"
    run b1 python -c "$SG" $B1 --output-json "$OUT/b1.json"
    run b1_short2 $CLI $B1 --output-json "$OUT/b1_short2.json"
    run int4_short $CLI $B1 --quantization int4 --output-json "$OUT/int4_short.json"
    run int4 python -c "$SG" $B1 --quantization int4 --output-json "$OUT/int4.json"
    ;;
  lmhead)  # queued: the LM head quantized too (`--quantize-lm-head`, off by default): its GPU tests, then
    # batch 1 per mode with it and without, alternating, and workload 3 in fp8 with it
    python -m pytest -q -m gpu -p no:cacheprovider tests/quantization/test_lm_head.py 2>&1 | tail -2
    B1="bench latency --num-iters 3 --shape qwen2.5-7b $SHORT"
    for q in fp8 int8 int4; do
      run "${q}_head" $CLI $B1 --quantization $q --quantize-lm-head --output-json "$OUT/${q}_head.json"
      run "$q" $CLI $B1 --quantization $q --output-json "$OUT/$q.json"
      run "${q}_head2" $CLI $B1 --quantization $q --quantize-lm-head --output-json "$OUT/${q}_head2.json"
    done
    run tput_fp8_head $TPUT --quantization fp8 --quantize-lm-head --output-json "$OUT/tput_fp8_head.json"
    ;;
  headdefault)  # the 8-bit modes with their LM head quantized by default: batch 1 bf16 / fp8 / int8 and
    # workload 3 bf16 / fp8, in one call (each "beside bf16 in the same run")
    B1="bench latency --num-iters 3 --shape qwen2.5-7b $SHORT"
    run b1_bf16 $CLI $B1 --output-json "$OUT/b1_bf16.json"
    for q in fp8 int8; do
      run "b1_$q" $CLI $B1 --quantization $q --output-json "$OUT/b1_$q.json"
    done
    grep -h "LM head in" "$OUT"/b1_*.log | head -2
    run tput_bf16 $TPUT --output-json "$OUT/tput_bf16.json"
    run tput_fp8 $TPUT --quantization fp8 --output-json "$OUT/tput_fp8.json"
    ;;
  stage3ttft)  # the extend kernel's third pipeline stage from 2048 queries instead of 4096
    # (`LONG_PREFILL_QUERIES`): the 2048-token TTFT with each, alternating, one process per run
    S3="import sys, qwick.layers.attention.triton_backend as T; T.LONG_PREFILL_QUERIES = 2048; \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    TT="bench latency --shape qwen2.5-7b --max-model-len 4096 --input-len 2048 --output-len 2 --num-iters 7"
    for i in 1 2; do
      run "ttft_4096_$i" $CLI $TT --output-json "$OUT/ttft_4096_$i.json"
      run "ttft_2048_$i" python -c "$S3" $TT --output-json "$OUT/ttft_2048_$i.json"
    done
    ;;
  int4head)  # int4's LM head in int8 by default: its GPU tests, then batch 1 with the int8 head (the
    # default), a bf16 head and a 4-bit head, alternating, one process per run
    python -m pytest -q -m gpu -p no:cacheprovider tests/quantization/test_lm_head.py \
      tests/quantization/test_int4_on_the_fly.py 2>&1 | tail -2
    B1="bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization int4"
    run b1_int4_head8 $CLI $B1 --output-json "$OUT/b1_int4_head8.json"
    run b1_int4_head16 $CLI $B1 --no-quantize-lm-head --output-json "$OUT/b1_int4_head16.json"
    run b1_int4_head4 $CLI $B1 --quantize-lm-head --output-json "$OUT/b1_int4_head4.json"
    run b1_int4_head8_2 $CLI $B1 --output-json "$OUT/b1_int4_head8_2.json"
    grep -ho "LM head in [a-z0-9]*" "$OUT"/b1_int4_head*.log | sort | uniq -c
    ;;
  w3kv)  # workload 3: bf16, fp8 weights, fp8 weights with an fp8 KV cache, in one call
    run tput_bf16 $TPUT --output-json "$OUT/tput_bf16.json"
    run tput_fp8 $TPUT --quantization fp8 --output-json "$OUT/tput_fp8.json"
    run tput_fp8_kv8 $TPUT --quantization fp8 --kv-cache-dtype fp8 --output-json "$OUT/tput_fp8_kv8.json"
    ;;
  shortdecode)  # one-row decode attention at short contexts: launch shapes and splits (the one-split
    # graphs' case), then int4 batch 1 with the fastest shape against the default, one process per run
    python benchmarks/short_decode_sweep.py "$OUT/short_best.json"
    B1="bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization int4"
    run b1_int4_default $CLI $B1 --output-json "$OUT/b1_int4_default.json"
    run b1_int4_best python benchmarks/b1_with_decode_cfg.py "$OUT/short_best.json" $B1 \
      --output-json "$OUT/b1_int4_best.json"
    run b1_int4_default2 $CLI $B1 --output-json "$OUT/b1_int4_default2.json"
    ;;
  int4mid)  # int4 at 17+ rows through the tiled W4A16 kernel (`PackedLinearMethod.tiled_max_m`, off):
    # its GPU tests, the layer timings and launch-shape sweep against dequantize-then-cuBLAS
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py \
      tests/quantization/test_int4_on_the_fly.py 2>&1 | tail -2
    python benchmarks/w4a16_mid_m.py 2>&1 | tee "$OUT/w4a16_mid_m.log" | grep -v -i warn
    ;;
  int4tiles)  # the tiled kernel's variants (reshape, nibble-pair dots) at 2-128 rows beside what the
    # layer runs now; first their GPU tests
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py -k tiled 2>&1 | tail -2
    MS="2 8 16 32 64 128" python benchmarks/w4a16_mid_m.py 2>&1 | tee "$OUT/w4a16_tiles.log" | grep -v -i warn
    ;;
  int4small_e2e)  # 2-16 rows through the tiled kernel (`tiled_min_m = 2`) against `quant_matmul` (the
    # default): 16 and 8 concurrent requests, one process per run
    SMALL="import sys; from qwick.quantization.int4 import PackedLinearMethod as P; P.tiled_min_m = 2; \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    T="bench throughput --shape qwen2.5-7b --max-model-len 4096 --input-len 128 --output-len 256 --num-iters 1"
    for n in 16 8; do
      run t${n}_int4 $CLI $T --num-prompts $n --quantization int4 --output-json "$OUT/t${n}_int4.json"
      run t${n}_int4_small python -c "$SMALL" $T --num-prompts $n --quantization int4 \
        --output-json "$OUT/t${n}_int4_small.json"
    done
    ;;
  prefillgraphs)  # a lone prompt chunk of up to 1,024 tokens replays a CUDA graph (`PREFILL_GRAPH_TOKENS`):
    # its GPU tests with the decode graphs', then the TTFT with the graphs and without, alternating in one
    # process (bf16, int4, fp8 at 32, 128 and 512 tokens), and batch 1 as `qwick bench latency` measures it
    python -m pytest -q -m gpu -p no:cacheprovider tests/runner/test_prefill_graphs.py \
      tests/runner/test_cuda_graphs.py tests/runner/test_output_rows.py 2>&1 | tail -3
    python benchmarks/prefill_graph_ttft.py qwen2.5-7b 10 2>&1 | grep -E "TTFT|prefill|Error"
    run b1_bf16 $LAT --shape qwen2.5-7b $SHORT --output-json "$OUT/b1_bf16.json"
    ;;
  mixedsplit)  # steps of decode rows and one prompt chunk as two graph replays (`split_mixed_max_tokens`, 512
    # since the nineteenth session): its GPU test, then the TTFT of prompts arriving beside 8 and 64
    # decoders, split and eager alternating in one process (128- and 1024-token prompts; bf16, int4)
    python -m pytest -q -m gpu -p no:cacheprovider tests/runner/test_split_mixed_steps.py 2>&1 | tail -8
    for busy in 8 64; do
      for len in 128 1024; do
        BUSY=$busy LEN=$len python benchmarks/mixed_split_ttft.py qwen2.5-7b 8 2>&1 | grep -E "TTFT|Error"
      done
    done
    QUANT=int4 BUSY=8 LEN=128 python benchmarks/mixed_split_ttft.py qwen2.5-7b 8 2>&1 | grep -E "TTFT|Error"
    ;;
  decodewrite)  # pure decode steps writing their keys and values inside the decode kernel
    # (`FUSE_DECODE_WRITE`, on for bf16 caches): its GPU tests, then batch 1 (bf16, int4, fp8) with it
    # and without, alternating processes
    python -m pytest -q -m gpu -p no:cacheprovider tests/layers/test_triton_attention.py \
      -k "writes_the_new_keys or rope_fused" 2>&1 | tail -2
    python -m pytest -q -m gpu -p no:cacheprovider tests/runner/test_cuda_graphs.py 2>&1 | tail -2
    FUSED="import sys; import qwick.layers.attention.triton_backend as T; T.FUSE_DECODE_WRITE = True; \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    for q in none int4 fp8; do
      Q=$([ $q = none ] || echo "--quantization $q")
      for i in ${REPS:-1 2}; do
        run b1_${q}_fused_$i python -c "$FUSED" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT $Q \
          --output-json "$OUT/b1_${q}_fused_$i.json"
        run b1_${q}_$i $LAT --shape qwen2.5-7b $SHORT $Q --output-json "$OUT/b1_${q}_$i.json"
      done
    done
    ;;
  int4_14b)  # the tiled int4 kernel's launch shapes (tuned at 7b shapes) on qwen2.5-14b's layers, bf16
    SHAPE=qwen2.5-14b MS="2 16 32 64 128" python benchmarks/w4a16_mid_m.py 2>&1 | grep -v -i warn
    ;;
  int4_14b_e2e)  # the two launch-shape cases that 14b's sweep added (`WIDE_TILE_WAVES`,
    # `MIN_K_PER_FOUR_SPLITS` in qwick/kernels/w4a16.py): the tiled kernel's GPU tests, the sweep at 32 and 64
    # rows (its "default" column should now equal the best), then 32 and 64 concurrent 14b int4 requests
    # with the new cases and without (both set to infinity), one process each
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py 2>&1 | tail -2
    SHAPE=qwen2.5-14b MS="32 64" python benchmarks/w4a16_mid_m.py 2>&1 | grep -v -i warn
    OLD14="import sys; import qwick.kernels.w4a16 as W; W.WIDE_TILE_WAVES = W.MIN_K_PER_FOUR_SPLITS = float('inf'); \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    T="bench throughput --shape qwen2.5-14b --max-model-len 4096 --input-len 128 --output-len 256 --num-iters 1 \
      --quantization int4"
    for n in ${NS:-32 64}; do  # NS="64": one level per call if a call runs short of time
      run t${n}_14b_int4 $CLI $T --num-prompts $n --output-json "$OUT/t${n}_14b_int4.json"
      run t${n}_14b_int4_old python -c "$OLD14" $T --num-prompts $n --output-json "$OUT/t${n}_14b_int4_old.json"
    done
    ;;
  rowquant)  # launch shapes of the kernels writing fp8 codes at 17-8192 rows (benchmarks/row_quant_launch.py),
    # then workload 3 in fp8 with the fastest at 256 rows patched in above 16 rows and without (ABAB)
    timeout 150 python benchmarks/row_quant_launch.py --json "$OUT/rowquant.json" 2>&1 | grep -v -i warn
    T3="bench throughput --shape qwen2.5-7b --max-model-len 4096 --num-prompts 256 --input-len-range 100 1024 \
      --output-len-range 100 1024 --num-iters 1 --quantization fp8"
    for i in 1 2; do
      run w3_fp8_default$i $CLI $T3 --output-json "$OUT/w3_fp8_default$i.json"
      run w3_fp8_tuned$i python benchmarks/row_quant_launch.py --apply "$OUT/rowquant.json" -- $T3 \
        --output-json "$OUT/w3_fp8_tuned$i.json"
    done
    ;;
  rowquant_e2e)  # after the rowquant picks became the defaults: the GPU tests of the kernels they launch, the
    # sweep again at 64 and 256 rows (its starred defaults should be the fastest), workload 3 in bf16 and
    # fp8 in one call (the fp8 ratio)
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_elementwise.py \
      tests/kernels/test_w8a8_kernels.py tests/quantization/test_w8a8_gpu.py 2>&1 | tail -3
    python benchmarks/row_quant_launch.py --rows 64 256 2>&1 | grep -v -i warn
    run tput_bf16 $TPUT --output-json "$OUT/tput_bf16.json"
    run tput_fp8 $TPUT --quantization fp8 --output-json "$OUT/tput_fp8.json"
    run tput_fp8b $TPUT --quantization fp8 --output-json "$OUT/tput_fp8b.json"
    ;;
  next22)  # the twenty-second session's two unrun changes: the sampling race spread over ~8 programs per SM
    # (`race_sample(programs_per_sm=8)`, was 2) and SiLU-and-mul's codes from the row kept in registers
    # (`silu_and_mul_quant(in_registers=None)`, was read back). Their GPU tests; the race by programs per
    # SM at 1-256 rows; the code kernels' sweep at 64 / 256 / 2048 rows (SiLU "r" against "m"); workload 3
    # in fp8 new, old (both patched back), new (one process each) and bf16 once; then, if time is left,
    # the split-K fp8 GEMM against cuBLAS on the down projection just above 128 rows
    timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_sampling.py \
      tests/runner/test_sampler.py tests/kernels/test_elementwise.py 2>&1 | tail -2
    python benchmarks/small_kernels.py race 2>&1 | grep -v -i warn
    python benchmarks/row_quant_launch.py --rows 64 256 2048 2>&1 | grep -v -i warn | grep "silu\|{"
    OLD="import sys; import qwick.kernels.sampling as S; import qwick.kernels.elementwise as E; \
f = S.race_sample; S.race_sample = lambda *a, **k: f(*a, **{**k, 'programs_per_sm': 2}); \
g = E.silu_and_mul_quant; E.silu_and_mul_quant = lambda x, q, *a, **k: g(x, q, *a, **{**k, 'in_registers': False}); \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    run tput_fp8_new1 $TPUT --quantization fp8 --output-json "$OUT/tput_fp8_new1.json"
    run tput_fp8_old python -c "$OLD" ${TPUT#python -m qwick.entrypoints.cli } --quantization fp8 \
      --output-json "$OUT/tput_fp8_old.json"
    run tput_fp8_new2 $TPUT --quantization fp8 --output-json "$OUT/tput_fp8_new2.json"
    run tput_bf16 $TPUT --output-json "$OUT/tput_bf16.json"
    MS=136,160 WIDE=1 timeout 60 python benchmarks/fp8_mid_m_sweep.py 7b down 2>&1 | grep -v -i "warn\|skip"
    ;;
  next23)  # the twenty-third session's picks from `next22` and `tma`: the fp8 down projection through the
    # TMA split-K GEMM up to 256 rows (`rowwise_max_m` 256, 64 x 128 tiles split 4 / 3 / 2), SiLU's codes
    # from registers only up to 64 rows. GPU tests; the default against cuBLAS at 65-256 rows; the SiLU
    # sweep at 128 rows (64 and 256 ran in `tma`); workload 3 in fp8 new, old (patched back), new, and bf16
    timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w8a8_kernels.py \
      tests/kernels/test_elementwise.py -k "rowwise or layer or silu" 2>&1 | tail -2
    MS=65,96,128,129,160,192,224,256 WIDE=0 timeout 60 python benchmarks/fp8_mid_m_sweep.py 7b down 2>&1 \
      | grep -v -i "warn"
    timeout 60 python benchmarks/row_quant_launch.py --rows 128 2>&1 | grep -v -i warn | grep "silu"
    OLD="import sys, triton; import qwick.kernels.w8a8 as K; import qwick.kernels.elementwise as E; \
from qwick.quantization.w8a8 import W8A8LinearMethod as M; M.rowwise_max_m = 128; f = K.rowwise_config; \
K.rowwise_config = lambda m, n, k, ws: f(m, n, k, ws) if m <= 64 else K.RowwiseConfig(128, 64, 128, 4, 4, 4); \
E.silu_codes_in_registers = lambda n, rows, block=4096: triton.cdiv(n, block) <= 8; \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    run tput_fp8_new1 $TPUT --quantization fp8 --output-json "$OUT/tput_fp8_new1.json"
    run tput_fp8_old python -c "$OLD" ${TPUT#python -m qwick.entrypoints.cli } --quantization fp8 \
      --output-json "$OUT/tput_fp8_old.json"
    run tput_fp8_new2 $TPUT --quantization fp8 --output-json "$OUT/tput_fp8_new2.json"
    run tput_bf16 $TPUT --output-json "$OUT/tput_bf16.json"
    ;;
  prof24)  # where a batch-1 step goes now, per launch shape (qkv / o / gate/up / down told apart by their
    # grids), fp8 and int4; then fp8 batch 1 with its 128-token TTFT
    for q in fp8 int4; do
      QUANT=$q BATCHES= OUT=$OUT timeout 200 python benchmarks/decode_step_profile.py >"$OUT/prof_$q.log" 2>&1
      grep -E "median|replay|compute_logits" "$OUT/prof_$q.log"
      sed -n '/per launch shape/,$p' "$OUT/prof_$q.log" | head -30
    done
    run fp8 $LAT --shape qwen2.5-7b $SHORT --quantization fp8 --output-json "$OUT/lat_fp8.json"
    ;;
  b1sweep)  # batch-1 fp8 GEMV launch shapes in CUDA graphs over L2-overflowing weight copies (qkv, o, down,
    # LM head; LAYERS, and ROWS / WARPS / SAMPLE to narrow or widen the sample: see the script), the
    # default first
    SAMPLE=${SAMPLE:-30} timeout 500 python benchmarks/b1_gemv_graph_sweep.py "$OUT/b1_sweep.json" ${LAYERS:-} 2>&1 \
      | grep -v -i warn
    ;;
  w8a16cfg)  # the W8A16 launch shapes from `b1sweep` (o split 8 in 32 x 128 tiles, the LM head in 64 x 128):
    # the int8 sweep of o and the head with the old shapes, then batch 1 fp8 / int8 / int4 (its head is
    # int8) with the new and the old (patched back), alternating
    WEIGHT=int8 CONFIGS="32,256,4,4,3;32,256,1,4,4" timeout 120 python benchmarks/b1_gemv_graph_sweep.py \
      "$OUT/b1_sweep_int8.json" o head 2>&1 | grep -v -i warn
    OLDCFG="import sys; import qwick.kernels.gemv as G; f = G.default_config; \
G.default_config = lambda m, n, k, sms, w_bytes=2, codes=False: (G.GemvConfig(32, 256, 1, num_stages=4) \
if n >= 16384 else G.GemvConfig(32, 256, 4, num_stages=3) if k < 12288 else f(m, n, k, sms, w_bytes, codes)) \
if w_bytes == 1 and not codes else f(m, n, k, sms, w_bytes, codes); \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    for q in fp8 int8 int4; do
      run "${q}_new" $LAT --shape qwen2.5-7b $SHORT --quantization $q --output-json "$OUT/lat_${q}_new.json"
      run "${q}_old" python -c "$OLDCFG" ${LAT#python -m qwick.entrypoints.cli } --shape qwen2.5-7b $SHORT \
        --quantization $q --output-json "$OUT/lat_${q}_old.json"
    done
    ;;
  tma)  # the split-K fp8 GEMM with its tiles loaded through tensor descriptors (`RowwiseConfig.tma`): its GPU
    # tests, then 88 launch shapes against cuBLAS on 7b's down projection at 128-256 rows, where cuBLAS's
    # 56 output tiles leave most SMs idle (promotion every 128 / 256 products of K, and never, to see its cost)
    timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w8a8_kernels.py -k rowwise \
      2>&1 | tail -2
    MS=128,192,256 WIDE=2 timeout 400 python benchmarks/fp8_mid_m_sweep.py 7b down 2>&1 | grep -v -i "warn\|skip"
    ;;
  graphrows)  # prefill graphs of up to 4 rows (`PREFILL_GRAPH_ROWS`, 4 by default): a new prompt beside a
    # few decode rows in one replay. Its GPU tests (and the one-row ones again), then the TTFT of prompts
    # arriving beside 1 and 3 decoders with 4-row graphs and with 1-row ones (eager mixed steps), one
    # process each, and batch 1 (its decode must not change)
    python -m pytest -q -m gpu -p no:cacheprovider tests/runner/test_prefill_graphs.py \
      tests/runner/test_split_mixed_steps.py tests/runner/test_cuda_graphs.py \
      tests/runner/test_memory_budget.py 2>&1 | tail -15
    ROWS4="import sys, runpy; import qwick.runner.prefill_graphs as G; G.PREFILL_GRAPH_ROWS = 4; \
sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    for busy in 1 3; do
      BUSY=$busy LEN=128 SPLIT=0 python benchmarks/mixed_split_ttft.py qwen2.5-7b 8 2>&1 | grep -E "TTFT|Error"
      BUSY=$busy LEN=128 SPLIT=0 python -c "$ROWS4" benchmarks/mixed_split_ttft.py qwen2.5-7b 8 2>&1 \
        | grep -E "TTFT|Error"
    done
    ;;
  graphrows4)  # after `PREFILL_GRAPH_ROWS` went to 4: the graph tests again, then batch 1 (128-token TTFT
    # and decode, bf16 and int4) with 4-row graphs and 1-row ones, one process each, and their capture cost
    python -m pytest -q -m gpu -p no:cacheprovider tests/runner/test_prefill_graphs.py \
      tests/runner/test_split_mixed_steps.py tests/runner/test_memory_budget.py 2>&1 | tail -15
    ROWS1="import sys; import qwick.runner.prefill_graphs as G; G.PREFILL_GRAPH_ROWS = 1; \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    for q in none int4; do
      Q=$([ $q = none ] || echo "--quantization $q")
      run b1_${q}_rows4 $LAT --shape qwen2.5-7b $SHORT $Q --output-json "$OUT/b1_${q}_rows4.json"
      run b1_${q}_rows1 python -c "$ROWS1" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT $Q \
        --output-json "$OUT/b1_${q}_rows1.json"
      grep -h "prefill CUDA graphs" "$OUT/b1_${q}_rows4.log" "$OUT/b1_${q}_rows1.log"
    done
    ;;
  roundto)  # the rotary products rounded in PTX (`round_to`, the nineteenth session): the rope and fused
    # write tests now demand PyTorch's / the separate write's bits; the fp8-cache graph test as it is and
    # with the fused decode write off; batch 1 (bf16, int4; fp8 weights with an fp8 cache, its
    # fused write on and off)
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_elementwise.py -k rope 2>&1 | tail -8
    python -m pytest -q -m gpu -p no:cacheprovider tests/layers/test_triton_attention.py \
      -k "writes_the_new_keys or rope_fused or fused_by_default" 2>&1 | tail -8
    for w in base nofuse; do python benchmarks/fp8_graph_diag.py $w 2>&1 | grep -E "exit|Error|assert"; done
    run b1_none $LAT --shape qwen2.5-7b $SHORT --output-json "$OUT/b1_none.json"
    run b1_int4 $LAT --shape qwen2.5-7b $SHORT --quantization int4 --output-json "$OUT/b1_int4.json"
    FP8SEP="import sys; import qwick.layers.attention.triton_backend as T; T.FUSE_DECODE_WRITE = False; \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    run b1_fp8kv $LAT --shape qwen2.5-7b $SHORT --quantization fp8 --kv-cache-dtype fp8 \
      --output-json "$OUT/b1_fp8kv.json"
    run b1_fp8kv_separate python -c "$FP8SEP" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT \
      --quantization fp8 --kv-cache-dtype fp8 --output-json "$OUT/b1_fp8kv_separate.json"
    ;;
  int4ttft)  # int4's short-prompt TTFT with the 65-128-row tiled path and without, alternating in one
    # process (128 and 96 tokens), and the host's eager cost per int4 call beside its GPU time
    python benchmarks/int4_ttft_ab.py qwen2.5-7b 128 15 2>&1 | grep -E "TTFT|Error"
    python benchmarks/int4_ttft_ab.py qwen2.5-7b 96 15 2>&1 | grep -E "TTFT|Error"
    python benchmarks/int4_eager_host.py 2>&1 | grep -v -i warn
    ;;
  int4models)  # int4 at the model level with 8-row decode steps (the tiled kernel's 16-row tiles since
    # the seventeenth session), against transformers on the dequantized weights, 7b shapes
    BATCH=8 REF32=0 python benchmarks/greedy_vs_transformers.py int4 2>&1 | grep -E "^(quantization|prompt)|Error"
    ;;
  int4half)  # fp16 models (Qwen's AWQ / GPTQ-Int4 releases): the tiled kernel decoding in packed fp16
    # math (`PackedLinearMethod.tiled_half_decode`, off) against fp32 math: the bit-exactness test, the
    # layer sweep in fp16, then 16 and 64 concurrent fp16 int4 requests with it and without
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py -k bit_for_bit 2>&1 | tail -2
    DTYPE=float16 MS="2 16 32 64 128" python benchmarks/w4a16_mid_m.py 2>&1 | grep -v -i warn
    HALF="import sys; from qwick.quantization.int4 import PackedLinearMethod as P; P.tiled_half_decode = True; \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    T="bench throughput --shape qwen2.5-7b --dtype float16 --max-model-len 4096 --input-len 128 --output-len 256 \
      --num-iters 1 --quantization int4"
    for n in 16 64; do
      run t${n}_fp16_int4 $CLI $T --num-prompts $n --output-json "$OUT/t${n}_fp16_int4.json"
      run t${n}_fp16_int4_half python -c "$HALF" $T --num-prompts $n --output-json "$OUT/t${n}_fp16_int4_half.json"
    done
    ;;
  int4pipe_e2e)  # the pipelined tiled kernel at 2-128 rows (the default since the seventeenth session):
    # PART=1: its GPU tests, 16 and 128 concurrent requests with it and without (2-16 rows through
    # `quant_matmul`; 65-128 rows dequantized); PART=2: 8 concurrent with it and without, 32 and 64 with it,
    # batch 1, the 7b/14b layer tests. One process per run.
    T="bench throughput --shape qwen2.5-7b --max-model-len 4096 --input-len 128 --output-len 256 --num-iters 1"
    patched() {  # a PackedLinearMethod attribute, value: the qwick CLI with it set
      echo "import sys; from qwick.quantization.int4 import PackedLinearMethod as P; P.$1 = $2; \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    }
    if [ "${PART:-1}" = 1 ]; then
      python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py \
        tests/quantization/test_int4_on_the_fly.py 2>&1 | tail -2
      python -m pytest -q -m gpu -p no:cacheprovider tests/runner/test_no_compiles_while_serving.py \
        -k int4 2>&1 | tail -2
      for n in 16 128; do
        run t${n}_int4 $CLI $T --num-prompts $n --quantization int4 --output-json "$OUT/t${n}_int4.json"
      done
      run t16_int4_old python -c "$(patched tiled_min_m 17)" $T --num-prompts 16 --quantization int4 \
        --output-json "$OUT/t16_int4_old.json"
      run t128_int4_old python -c "$(patched tiled_max_m 64)" $T --num-prompts 128 --quantization int4 \
        --output-json "$OUT/t128_int4_old.json"
    else
      run t8_int4 $CLI $T --num-prompts 8 --quantization int4 --output-json "$OUT/t8_int4.json"
      run t8_int4_old python -c "$(patched tiled_min_m 17)" $T --num-prompts 8 --quantization int4 \
        --output-json "$OUT/t8_int4_old.json"
      for n in 32 64; do
        run t${n}_int4 $CLI $T --num-prompts $n --quantization int4 --output-json "$OUT/t${n}_int4.json"
      done
      run b1_int4 $CLI bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization int4 \
        --output-json "$OUT/b1_int4.json"
      python -m pytest -q -m gpu -p no:cacheprovider tests/quantization/test_int4_layer_gpu.py 2>&1 | tail -2
    fi
    ;;
  int4mid_e2e)  # the second call of int4mid: 64 and 32 concurrent requests with the tiled kernel (the
    # default up to 64 rows) and without (and bf16), and batch 1 (the TTFT of a 128-token prompt) with it
    # and without (and bf16's, for the int4 prefill's cost), one process per run
    T64="bench throughput --shape qwen2.5-7b --max-model-len 4096 --input-len 128 --output-len 256 \
      --num-iters 1"
    OFF="import sys; from qwick.quantization.int4 import PackedLinearMethod as P; P.tiled_max_m = 0; \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    RESHAPE="import sys, dataclasses; import qwick.kernels.w4a16 as K; f = K.tiled_w4_config; \
K.tiled_w4_config = lambda *a: dataclasses.replace(f(*a), block_m=64, block_n=128, nibble_dots=False); \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    if [ "${NIBBLE_AB:-0}" = 1 ]; then  # 17-32 rows: the nibble dots (default) against the reshape
      run t32_int4 $CLI $T64 --num-prompts 32 --quantization int4 --output-json "$OUT/t32_int4.json"
      run t32_int4_reshape python -c "$RESHAPE" $T64 --num-prompts 32 --quantization int4 \
        --output-json "$OUT/t32_int4_reshape.json"
      run t32_int4_2 $CLI $T64 --num-prompts 32 --quantization int4 --output-json "$OUT/t32_int4_2.json"
      exit 0
    fi
    for n in 64 32; do
      run t${n}_int4 $CLI $T64 --num-prompts $n --quantization int4 --output-json "$OUT/t${n}_int4.json"
      run t${n}_int4_off python -c "$OFF" $T64 --num-prompts $n --quantization int4 \
        --output-json "$OUT/t${n}_int4_off.json"
    done
    run t64_bf16 $CLI $T64 --num-prompts 64 --output-json "$OUT/t64_bf16.json"
    B1="bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization int4"
    run b1_int4 $CLI $B1 --output-json "$OUT/b1_int4.json"
    run b1_int4_off python -c "$OFF" $B1 --output-json "$OUT/b1_int4_off.json"
    run b1_bf16 $CLI bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --output-json "$OUT/b1_bf16.json"
    ;;
  headw8a8)  # decode-sized LM-head rows quantized for the W8A8 skinny GEMM (`decode_quantize_min_n`, on)
    # against W8A16: the head tests, then batch 1 fp8 / int8 / int4 with it and without, alternating
    timeout 200 python -m pytest -q -m gpu tests/kernels/test_w8a8_kernels.py -k "lm_head or paths" \
      tests/quantization/test_lm_head.py 2>&1 | tail -3
    OFF="import sys; from qwick.quantization.w8a8 import W8A8LinearMethod as M; \
M.decode_quantize_min_n = 1 << 30; from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    for q in ${MODES:-fp8 int8 int4}; do
      B1="bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization $q"
      run b1_${q}_on $CLI $B1 --output-json "$OUT/b1_${q}_on.json"
      run b1_${q}_off python -c "$OFF" $B1 --output-json "$OUT/b1_${q}_off.json"
    done
    ;;
  int4shapes)
    # the 31st session's rule (every shape 32 rows x 4 warps) patched in, against the default since the
    # 32nd (o 64 rows x 8 warps, down 2 warps with the prefetch): 505.1 / 504.8 against 502.1 / 502.6
    SHAPES31="import sys, dataclasses; import qwick.kernels.row_gemv_half2 as h
base = h.default_half2_config
def plain(n, kw, num_sms):
    cfg = base(n, kw, num_sms)
    return dataclasses.replace(cfg, block_n=32, num_warps=4, prefetch=False)
h.default_half2_config = plain
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    alternate b1_int4_shapes b1_int4_rule31 "$SHAPES31" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT \
      --quantization int4
    ;;
  int8row)
    INT8ROW="import sys, dataclasses, torch; import qwick.kernels.row_gemv_w8 as r
from qwick.quantization.w8a8 import W8A8LinearMethod as M
M._row_gemv = lambda self, x, n, k: x.shape[0] == 1 and n < self.row_gemv_max_n and k <= self.decode_w8a8_max_k \
    and k % 128 == 0
real = r.w8_row_gemv
def prefetched(x, codes, scale, bias, ws, config=None):  # int8's best o launch in the 31st session's sweep
    if config is None and codes.dtype == torch.int8:
        config = dataclasses.replace(r.default_w8_row_config(*codes.shape, ws.num_sms), prefetch=True)
    return real(x, codes, scale, bias, ws, config)
r.w8_row_gemv = prefetched
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    alternate b1_int8_default b1_int8_row "$INT8ROW" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT \
      --quantization int8
    ;;
  w8row)
    timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_row_gemv_w8.py \
      tests/kernels/test_w8a8_kernels.py -k "row_gemv or decode or (matches_dequantized and fp8 and not block)" \
      2>&1 | tail -2
    NOROW="import sys; from qwick.quantization.w8a8 import W8A8LinearMethod as M; M.row_gemv_max_n = 0; \
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    B1="bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization fp8"
    alternate b1_fp8_row b1_fp8_norow "$NOROW" $B1
    ;;
  tiles32)
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_row_gemv.py \
      tests/quantization/test_int4_on_the_fly.py 2>&1 | tail -2
    ROWS64="import sys, triton; import qwick.kernels.row_gemv_half2 as h
def rows64(n, kw, num_sms):  # the default before the 31st session: 64 rows, grids up to 4 programs per SM
    tiles, k_tiles, split = triton.cdiv(n, 64), kw // h.tile_words_for(kw), 1
    while tiles * split < 4 * num_sms and k_tiles >= 2 * split:
        split *= 2
    return h.RowGemvConfig(64, h.tile_words_for(kw), split)
h.default_half2_config = rows64
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    B1="bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization int4"
    alternate b1_int4_rows32 b1_int4_rows64 "$ROWS64" $B1
    ;;
  fused33)  # the 33rd session's two fusions for int4 batch 1: SiLU-and-mul in the gate/up GEMV's epilogue
    # (`gated_decode`, on since the 35th session) and the o projection's norm in its tail (`normed_decode`,
    # on since the 36th session). Their GPU tests, the int4 greedy check with both on; then `fused33ab`: batch 1 with neither,
    # each and both, round-robin
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_row_gemv.py tests/kernels/test_gemv.py \
      tests/quantization/test_int4_on_the_fly.py tests/kernels/test_elementwise.py \
      tests/models/test_fused_launches.py 2>&1 | tail -2
    python -c "from qwick.quantization.int4 import PackedLinearMethod as M
M.gated_decode = M.normed_decode = True
import runpy, sys; sys.argv = ['greedy_vs_transformers.py', 'int4']
runpy.run_path('benchmarks/greedy_vs_transformers.py', run_name='__main__')" 2>&1 | grep -i "diverge\|max" | head -4
    ;;
  fused33ab)
    B1="bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization int4"
    for i in ${REPS_LIST:-1 2}; do
      for v in ${VARIANTS:-none gated normed all}; do  # normed: the o projection's norm (`normed_half2_config`)
        G=False; N=False
        [ $v = gated ] || [ $v = all ] && G=True
        [ $v = normed ] || [ $v = all ] && N=True
        run b1_int4_${v}_$i python -c "import sys; from qwick.quantization.int4 import PackedLinearMethod as M
M.gated_decode = $G; M.normed_decode = $N
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))" $B1 --output-json "$OUT/b1_int4_${v}_$i.json"
      done
    done
    ;;
  normedfix)  # the o norm's tail (`normed_decode`, on since the 36th session) after the 35th session's fix of its pairs: the
    # kernel tests (the tail's pairs 40 launches each), the int4 greedy check with it on, batch 1 with
    # the gated gate/up (the default) and it, or without it, alternating
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_row_gemv.py \
      tests/quantization/test_int4_on_the_fly.py -k "normed or tail" 2>&1 | tail -3
    REF32=0 python -c "from qwick.quantization.int4 import PackedLinearMethod as M
M.normed_decode = True
import runpy, sys; sys.argv = ['greedy_vs_transformers.py', 'int4']
runpy.run_path('benchmarks/greedy_vs_transformers.py', run_name='__main__')" 2>&1 | grep "prompt " | head -3
    OUT=$OUT VARIANTS="gated all" bash "$0" fused33ab
    ;;
  fused33quick)  # for a call with little device time left: the A/B first (what decides), the tests after
    t0=$(date +%s)
    LIMIT=${LIMIT:-480}  # the tests keep the last 120 s (fewer if the A/B ends early); run prints each figure
    OUT=$OUT REPS_LIST=${REPS_LIST:-1} VARIANTS=${VARIANTS:-none all gated normed} \
      timeout $((LIMIT > 180 ? LIMIT - 120 : 60)) bash "$0" fused33ab
    left=$((LIMIT - ($(date +%s) - t0)))
    timeout $((left > 30 ? left - 10 : 20)) python -m pytest -q -m gpu -p no:cacheprovider \
      tests/kernels/test_row_gemv.py tests/quantization/test_int4_on_the_fly.py tests/models/test_fused_launches.py \
      tests/kernels/test_gemv.py -k "gated or normed" 2>&1 | tail -8
    ;;
  fused33bf16)  # bf16 batch 1 with SiLU-and-mul in the gate/up skinny GEMM (`CudaLinearMethod.gated_decode`,
    # on since the 35th session) and without, alternating
    PLAIN="import sys; from qwick.layers.linear import CudaLinearMethod as M; M.gated_decode = False
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    alternate b1_bf16_gated b1_bf16_plain "$PLAIN" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT
    ;;
  pdl36)  # int4 batch 1 with the QKV and o GEMVs preloaded and launched early (`pdl_preload`, on since
    # the 36th session; QWICK_PDL=0 turns it off): the PDL tests, batch 1 with it and without,
    # alternating, the int4 greedy check, the graph tests
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_pdl.py tests/kernels/test_row_gemv.py \
      tests/quantization/test_int4_on_the_fly.py -k "preload" 2>&1 | tail -3
    B1="bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization int4"
    for i in ${REPS_LIST:-1 2}; do
      run b1_int4_pdl_$i $CLI $B1 --output-json "$OUT/b1_int4_pdl_$i.json"
      run b1_int4_nopdl_$i env QWICK_PDL=0 $CLI $B1 --output-json "$OUT/b1_int4_nopdl_$i.json"
    done
    REF32=0 python benchmarks/greedy_vs_transformers.py int4 2>&1 | grep "prompt " | head -3
    python -m pytest -q -m gpu -p no:cacheprovider tests/runner/test_cuda_graphs.py tests/models 2>&1 | tail -2
    ;;
  pdlmlp)  # the early-launched chain: o lets gate/up in (`pdl_mlp`), gate/up lets down in (`pdl_down`),
    # both on since the 47th session; down lets the next layer's input norm in and QKV decode attention
    # (`pdl_norm`, on), each GEMV once its programs are past their loops: int4 batch 1 with none (every
    # switch off), QWICK_PDL=0 (off), norm, mlp (`pdl_mlp` alone), both (the MLP chain) and all (the
    # default), round-robin (VARIANTS), then the tests
    B1="bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization int4"
    for i in ${REPS_LIST:-1 2}; do
      for v in ${VARIANTS:-none off norm both all}; do
        M=False; D=False; N=False; PDL=1
        [ $v = mlp ] || [ $v = both ] || [ $v = all ] && M=True
        [ $v = both ] || [ $v = all ] && D=True
        [ $v = norm ] || [ $v = all ] || [ $v = off ] && N=True
        [ $v = off ] && PDL=0
        run b1_int4_pdl${v}_$i env QWICK_PDL=$PDL python -c "import sys; from qwick.quantization.int4 import PackedLinearMethod as P
P.pdl_mlp = $M; P.pdl_down = $D; P.pdl_norm = $N
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))" $B1 --output-json "$OUT/b1_int4_pdl${v}_$i.json"
      done
    done
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_pdl.py tests/kernels/test_row_gemv.py \
      tests/quantization/test_int4_on_the_fly.py -k "preload or pdl" 2>&1 | tail -3
    ;;
  w8chain)  # one decode row's W8A8 GEMVs launched early and letting the next kernel in, with the norms and
    # decode attention after them launched early (`W8A8LinearMethod.pdl_norm`, on since the 39th session):
    # the GPU tests, then fp8 and int8 batch 1 with it off and on, alternating, then the greedy checks
    python -m pytest -q -m gpu -p no:cacheprovider tests/quantization/test_w8a8_gpu.py \
      tests/kernels/test_w8a8_kernels.py -k "pdl_norm or preloaded" 2>&1 | tail -3
    OFF="import sys; from qwick.quantization.w8a8 import W8A8LinearMethod as M; M.pdl_norm = False
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    for q in fp8 int8; do
      alternate b1_${q}_chain b1_${q}_off "$OFF" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization $q
    done
    [ "${W8CHAIN_AB_ONLY:-0}" = 1 ] && exit 0
    for q in fp8 int8; do
      REF32=0 python benchmarks/greedy_vs_transformers.py $q 2>&1 | grep "prompt " | head -3
    done
    ;;
  attnpreload)  # a lone decode row's attention reading its metadata and first key tile before it waits
    # for the QKV projection (`triton_backend.DECODE_PRELOAD`), then with QKV letting it in at its start
    # (`pdl_qkv_start`), then with the attention letting o in after its wait (`DECODE_TRIGGER_LATE`); all
    # on since the 40th session (+2.3% int4, +1.6% fp8, +1.8% int8 on an H100): the GPU tests, then int4
    # and fp8 batch 1 with none, preload, start and late (each adding to the one before), round-robin
    # (VARIANTS, REPS_LIST)
    python -m pytest -q -m gpu -p no:cacheprovider tests/layers/test_triton_attention.py \
      tests/quantization/test_w8a8_gpu.py tests/quantization/test_int4_on_the_fly.py \
      -k "pdl or preload or writes_the_new_keys" 2>&1 | tail -3
    for i in ${REPS_LIST:-1 2}; do
      for q in int4 fp8; do
        for v in ${VARIANTS:-none preload start late}; do
          P=False; S=False; L=False
          [ $v = none ] || P=True
          [ $v = start ] || [ $v = late ] && S=True
          [ $v = late ] && L=True
          run b1_${q}_${v}_$i python -c "import sys; from qwick.layers.attention import triton_backend as T
from qwick.quantization.int4 import PackedLinearMethod as P4
from qwick.quantization.w8a8 import W8A8LinearMethod as P8
T.DECODE_PRELOAD = $P; P4.pdl_qkv_start = P8.pdl_qkv_start = $S; T.DECODE_TRIGGER_LATE = $L
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))" bench latency --num-iters 3 \
            --shape qwen2.5-7b $SHORT --quantization $q --output-json "$OUT/b1_${q}_${v}_$i.json"
        done
      done
    done
    ;;
  gemvncu)  # why the W8A8 down GEMV streams at ~2.5 TB/s on an H100 against gate/up's ~3.0 (42nd
    # session, `benchmarks/critical_path.py`): the batch-1 GEMVs under Nsight Compute, one launch each
    # (`benchmarks/gemv_ncu.py`, with the W8A8 launches decode runs); the full text in $OUT/ncu.txt
    ncu --clock-control none --profile-from-start off --set full python benchmarks/gemv_ncu.py \
      /tmp/gemv_ncu_kernels >"$OUT/ncu.txt" 2>&1
    grep -E "rel err|^  [A-Za-z_].*\(|Duration|DRAM Throughput|Registers Per Thread|Achieved Occupancy|Issue Slots Busy|Cycles Per Issued|spends" \
      "$OUT/ncu.txt" | cut -c1-220 | head -300
    ;;
  half2sass)  # where the f16x2 int4 GEMV's warps stall, per SASS instruction (49th session: 42% on the code
    # words' loads, 34% at the two bar.sync a tile of the activation pairs' exchange through shared memory):
    # the gate/up launch of `benchmarks/gemv_ncu.py` under Nsight Compute, its source page summed by
    # `benchmarks/ncu_sass_stalls.py`; the CSV in $OUT
    ncu --clock-control none --profile-from-start off --set full --import-source yes \
      -k regex:_w4_half2_kernel --launch-count 1 -o /tmp/h2 python benchmarks/gemv_ncu.py /tmp/gemv_ncu_kernels \
      >"$OUT/half2sass.log" 2>&1
    ncu -i /tmp/h2.ncu-rep --page source --print-source sass --csv >"$OUT/h2_sass.csv" 2>&1
    python benchmarks/ncu_sass_stalls.py "$OUT/h2_sass.csv" 12 | head -20
    ;;
  ring)  # the int4 GEMV with its code tiles streamed by TMA through a shared-memory ring, warp-specialized
    # (`benchmarks/int4_ring_gemv.py`, a Gluon prototype), beside the f16x2 default: gate/up and down; under
    # `timeout` (a wrong mbarrier phase would hang)
    SHAPES=${SHAPES:-"gate_up down"} STAGES=${STAGES:-8} timeout ${RING_LIMIT:-240} \
      python benchmarks/int4_ring_gemv.py "$OUT/int4_ring_gemv.json" 2>&1 | grep -v Warning | cut -c1-300
    ;;
  staged)  # the int4 GEMV with the activation pairs staged in shared memory once per program and no barrier
    # in its loop (`benchmarks/int4_staged_gemv.py`, a Gluon prototype, 56th session), beside the f16x2
    # default at the four 7b shapes: the default's launch shape, then rows, warps and the two-tile prefetch
    timeout ${STAGED_LIMIT:-300} python benchmarks/int4_staged_gemv.py "$OUT/int4_staged_gemv.json" 2>&1 \
      | grep -v Warning | cut -c1-300
    ;;
  stagedab)  # the staged int4 GEMV in the engine (`int4_staged_gemv.install`: decode's QKV, o with its norm
    # tail, gated gate/up and down at the f16x2 launch shapes): its outputs against the f16x2 kernel's
    # (CHECK=1, exits 1 past 2e-3), then int4 batch 1 without and with it, alternating (REPS_LIST)
    CHECK=1 timeout 240 python benchmarks/int4_staged_gemv.py 2>&1 | grep -v Warning | tail -12 || exit 1
    STAGED="import sys; sys.path.insert(0, 'benchmarks'); import int4_staged_gemv as s; s.install()
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    alternate b1_int4_f16x2 b1_int4_staged "$STAGED" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT \
      --quantization int4
    ;;
  qkvshape)  # the W8A8 QKV GEMV's launch shape in the engine (56th session, H100: the default 64 x 256 split 4
    # 350.2 tok/s, split 8 340.2, 32 rows 348.9, 32 rows split 8 339.2): Q (default int8) batch 1 with the
    # default, then with `gemv.default_config` patched for the 7b QKV codes GEMV (rows,split in SHAPES)
    run "qkv_default" $LAT --shape qwen2.5-7b $SHORT --quantization "${Q:-int8}" --output-json "$OUT/qkv_default.json"
    for v in ${SHAPES:-64,8 32,4 32,8}; do
      P="import sys
import qwick.kernels.gemv as G
orig = G.default_config
def dc(m, n, k, sms, w_bytes=2, codes=False):
    if codes and m == 1 and n == 4608 and k == 3584:
        return G.GemvConfig(${v%,*}, 256, ${v#*,}, num_stages=3)
    return orig(m, n, k, sms, w_bytes, codes)
G.default_config = dc
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
      run "qkv_$v" python -c "$P" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization "${Q:-int8}" \
        --output-json "$OUT/qkv_$v.json"
    done
    ;;
  widetiles)  # the f16x2 int4 GEMV in 64-word tiles beside the default 32 (`benchmarks/int4_wide_tiles.py`,
    # CUDA graphs over L2-overflowing copies): one bar.sync pair a program per 1,024 code bytes, not 512
    python benchmarks/int4_wide_tiles.py "$OUT/int4_wide_tiles.json" 2>&1 | grep -v Warning
    ;;
  gatedmlp)  # one decode row's SiLU-and-mul in the W8A8 gate/up GEMV, its last tile of each group writing
    # the down projection's codes (`W8A8LinearMethod.gated_decode`, on for int8: +1.6% on an H100 in the
    # 52nd session; off for fp8: -0.5%): its GPU tests, then fp8 and int8 batch 1 as they are and with the
    # mode's switch flipped, alternating (REPS_LIST)
    python -m pytest -q -p no:cacheprovider tests/kernels/test_w8a8_kernels.py tests/quantization/test_w8a8_gpu.py \
      -k "gated_w8a8 or gated_decode" 2>&1 | tail -6
    for i in ${REPS_LIST:-1 2}; do
      for q in fp8 int8; do
        FLIP="import sys, torch; from qwick.quantization.w8a8 import W8A8LinearMethod as W
W.gated_decode = W.gated_decode ^ {torch.int8 if '$q' == 'int8' else torch.float8_e4m3fn}
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
        REPS_LIST=$i alternate "b1_${q}_default" "b1_${q}_flipped" "$FLIP" bench latency --num-iters 3 \
          --shape qwen2.5-7b $SHORT --quantization "$q"
      done
    done
    ;;
  gatedprof)  # where the gated W8A8 gate/up launch's time goes (52nd session, H100: int8 +1.6%, fp8 -0.5%):
    # the batch-1 step's critical path (`decode_step_profile.py`, `critical_path.py`), fp8 and int8, with
    # `gated_decode` off and on; the logs and traces in $OUT
    for q in fp8 int8; do
      for g in 0 1; do
        QUANT=$q GATED_DECODE=$g BATCHES= OUT=$OUT timeout 200 python benchmarks/decode_step_profile.py \
          >"$OUT/gatedprof_${q}_$g.log" 2>&1
        echo "== $q gated_decode $g"
        sed -n '/what each launch adds/,$p' "$OUT/gatedprof_${q}_$g.log" | head -16 | cut -c1-150
      done
    done
    ;;
  fusedsweep)  # the one-launch W8A8 MLP's launch shapes against the three launches
    # (`benchmarks/fused_mlp_w8.py`; its engine version, in commit a2a8c98, lost 2.2-3.1% at batch 1 with
    # deterministic sums and was removed)
    DOWN_TS=0 H_CODES=1 CS="64 128" BLOCK_KS="64 128" LAUNCHES="256,4,3 256,4,4 256,8,3 128,4,3" \
      run fusedsweep python benchmarks/fused_mlp_w8.py "$OUT/fused_mlp_w8.json"
    ;;
  normw)  # RMSNorm reading its weight with x and the residual, not after the row's sum
    # (`elementwise.NORM_WEIGHT_WITH_X`, on since the 42nd session; int4 +0.5% on an H100): its GPU tests, then
    # fp8, int8 and int4 batch 1 with it and with the old order, alternating (REPS_LIST)
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_elementwise.py tests/kernels/test_pdl.py \
      2>&1 | tail -3
    OLD="import sys; import qwick.kernels.elementwise as E; E.NORM_WEIGHT_WITH_X = False
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    for q in fp8 int8 int4; do
      alternate "b1_${q}_normw" "b1_${q}_normw_off" "$OLD" bench latency --num-iters 3 --shape qwen2.5-7b \
        $SHORT --quantization $q
    done
    ;;
  short512)  # a lone row's one-split graph up to 512 tokens (`cuda_graphs.SHORT_CONTEXT_ONE_ROW`, on since the
    # 43rd session: +2.0% fp8, +1.4% int4 on an H100 at 384 + 128 tokens; more rows keep 256): the graph
    # tests, then fp8 and int4 batch 1 at 384 + 128 tokens with it and with 256 (`SHORT_CONTEXT_ONE_ROW`
    # 0), alternating (REPS_LIST)
    python -m pytest -q -m gpu -p no:cacheprovider tests/runner/test_cuda_graphs.py 2>&1 | tail -3
    S256="import sys; import qwick.runner.cuda_graphs as C; C.SHORT_CONTEXT_ONE_ROW = 0
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    for q in fp8 int4; do
      alternate "b1_${q}_384_short512" "b1_${q}_384_short256" "$S256" bench latency --num-iters 3 \
        --shape qwen2.5-7b --max-model-len 4096 --input-len 384 --output-len 128 --quantization $q
    done
    ;;
  newkey)  # a lone decode row reading early scores the new key apart from its preloaded tile
    # (`triton_backend.DECODE_NEW_KEY_APART`, on since the 45th session: +2.5% fp8, +0.8% int4 on an
    # H200), so the tile is staged for the dot products before the wait: its GPU tests, then the QUANTS
    # (default "fp8 int4") batch 1 with the default and the flag flipped (the key merged into the tile
    # after the wait), alternating (REPS_LIST)
    python -m pytest -q -m gpu -p no:cacheprovider tests/layers/test_triton_attention.py \
      -k "preload or lone_row or writes_the_new_keys" 2>&1 | tail -3
    FLIP="import sys; from qwick.layers.attention import triton_backend as T
T.DECODE_NEW_KEY_APART = not T.DECODE_NEW_KEY_APART
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    for q in ${QUANTS:-fp8 int4}; do
      alternate "b1_${q}_default" "b1_${q}_apart_flipped" "$FLIP" bench latency --num-iters 3 \
        --shape qwen2.5-7b $SHORT --quantization $q
    done
    ;;
  preloadtile)  # a lone decode row reading early takes its keys 256 at a time on 8 warps, one stage
    # (`triton_backend.DECODE_PRELOAD_TILE`, on since the 42nd session: +1.5-1.9% on an H100), so a short
    # context is read whole before the wait: its GPU tests, then fp8, int8 and int4 batch 1 with it and with
    # the 128-key tiles (3 stages) it replaced, alternating (REPS_LIST)
    python -m pytest -q -m gpu -p no:cacheprovider tests/layers/test_triton_attention.py \
      -k "preload or lone_row or writes_the_new_keys" 2>&1 | tail -3
    OLD="import sys; from qwick.layers.attention import triton_backend as T
T.DECODE_PRELOAD_TILE = {'BLOCK_N': 128, 'num_warps': 8, 'num_stages': 3}
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    for q in fp8 int8 int4; do
      alternate "b1_${q}_tile256" "b1_${q}_tile128" "$OLD" bench latency --num-iters 3 --shape qwen2.5-7b \
        $SHORT --quantization $q
    done
    ;;
  tilewarps)  # the lone row's 256-key tile on TILE_WARPS (default 16) warps instead of 8
    # (`DECODE_PRELOAD_TILE`; sm_90, Triton 3.6: 236 registers a thread at 8 warps, 60K of an SM's 64K, so
    # the early-launched attention finds no room on an SM still running the int4 QKV GEMV's 9 programs;
    # 255 at 4 warps, -7.4% int4 in the 49th session; 128 and no spills at 16): its GPU tests with the
    # patch, then int4 and fp8 batch 1 with the default and with it, alternating (REPS_LIST)
    W4="import sys; from qwick.layers.attention import triton_backend as T
T.DECODE_PRELOAD_TILE = {'BLOCK_N': 256, 'num_warps': ${TILE_WARPS:-16}, 'num_stages': 1}"
    python -c "$W4
import pytest; sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', 'tests/layers/test_triton_attention.py',
  '-k', 'preload or lone_row or writes_the_new_keys']))" 2>&1 | tail -2
    for q in int4 fp8; do
      alternate "b1_${q}_tile8w" "b1_${q}_tile${TILE_WARPS:-16}w" "$W4
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))" bench latency --num-iters 3 \
        --shape qwen2.5-7b $SHORT --quantization $q
    done
    ;;
  int4coreside)  # int4's decode attention adds 5.45 us a layer against 3.6-4.0 in the 8-bit modes (56th session's
    # critical path, H100). Its early launch (8 warps, 236-255 registers a thread, ~60K of an SM's 64K) finds
    # no SM with room while the int4 QKV GEMV's 1,152 programs (9 an SM at 54 registers) still run. With
    # QKV split 4 (576 programs, ~4.4 an SM) and the attention on 4 warps (~32K), both fit one SM. int4
    # batch 1: the default, QKV split 4, both, alternating (REPS_LIST)
    QKV4="import sys; import qwick.kernels.row_gemv_half2 as H
from qwick.kernels.row_gemv import RowGemvConfig
orig = H.default_half2_config
H.default_half2_config = lambda n, kw, sms: RowGemvConfig(32, 32, 4) if (n, kw) == (4608, 448) else orig(n, kw, sms)"
    W4="from qwick.layers.attention import triton_backend as T
T.DECODE_PRELOAD_TILE = {'BLOCK_N': 256, 'num_warps': 4, 'num_stages': 1}"
    MAIN="from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    for i in ${REPS_LIST:-1 2}; do
      run "b1_int4_default_$i" $LAT --shape qwen2.5-7b $SHORT --quantization int4 --output-json "$OUT/b1_int4_default_$i.json"
      run "b1_int4_qkv4_$i" python -c "$QKV4
$MAIN" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization int4 --output-json "$OUT/b1_int4_qkv4_$i.json"
      run "b1_int4_qkv4_attn4w_$i" python -c "$QKV4
$W4
$MAIN" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization int4 \
        --output-json "$OUT/b1_int4_qkv4_attn4w_$i.json"
    done
    ;;
  recipcodes)  # activation codes by the scale's reciprocal and an fma correction (`codes_of`, 57th session;
    # the same bits as the per-element IEEE division before, -0.0 included since the 58th): the codes
    # kernels' GPU tests (failures listed), the one-row norm ablation and the codes kernels alone
    # (RECIP_KERNELS=0 skips those two); then int8 / fp8 batch 1 with it and with the division put back
    # (`norm_codes_ablation.use_division`), alternating (REPS_LIST). The 57th session's third arm, int8
    # with the norm on 16 warps, gained 0.1% on an H100 (58th session) and was dropped.
    timeout 150 python -m pytest -q -m gpu -p no:cacheprovider -rf --tb=no tests/kernels/test_w8a8_kernels.py \
      tests/kernels/test_elementwise.py -k "codes or quant or bit_identical or gated or norm" 2>&1 \
      | grep -E "FAILED|ERROR|passed|failed" | tail -30
    if [ "${RECIP_KERNELS:-1}" = 1 ]; then
      timeout 120 python -u benchmarks/norm_codes_ablation.py 2>&1 | tee "$OUT/norm_ablation.txt" | tail -30
      timeout 90 python -u benchmarks/decode_quant_kernels.py 2>&1 | tee "$OUT/decode_quant.txt" | tail -30
    fi
    DIV="import sys; import benchmarks.norm_codes_ablation as A; A.use_division()
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    B1="bench latency --num-iters 3 --shape qwen2.5-7b $SHORT"
    for i in ${REPS_LIST:-1 2}; do
      for q in int8 fp8; do
        run "b1_${q}_recip_$i" $CLI $B1 --quantization $q --output-json "$OUT/b1_${q}_recip_$i.json"
        run "b1_${q}_div_$i" python -c "$DIV" $B1 --quantization $q --output-json "$OUT/b1_${q}_div_$i.json"
      done
    done
    ;;
  fp8pdl)  # the fp8 o projection's row GEMV launched early after decode attention, its first two tiles
    # preloaded (`W8A8LinearMethod.pdl_preload`, off): fp8 batch 1 with it and without, alternating
    # (FP8PDL_AB_ONLY=1: that alone), the fp8 greedy check with it, its kernel tests
    ON="import sys; from qwick.quantization.w8a8 import W8A8LinearMethod as M; M.pdl_preload = True
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    alternate b1_fp8_plain b1_fp8_pdl "$ON" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization fp8
    [ "${FP8PDL_AB_ONLY:-0}" = 1 ] && exit 0
    REF32=0 python -c "from qwick.quantization.w8a8 import W8A8LinearMethod as M
M.pdl_preload = True
import runpy, sys; sys.argv = ['greedy_vs_transformers.py', 'fp8']
runpy.run_path('benchmarks/greedy_vs_transformers.py', run_name='__main__')" 2>&1 | grep "prompt " | head -3
    python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_row_gemv_w8.py 2>&1 | tail -2
    ;;
  int8pdl)  # int8's o projection on the same early-launched row GEMV (int8 keeps the tensor-core W8A16
    # GEMV for o: the row GEMV alone gained 0.15% in the 32nd session) against the default, alternating
    ON="import sys; from qwick.quantization.w8a8 import W8A8LinearMethod as M; M.pdl_preload = True
M._row_gemv = lambda self, x, n, k: x.shape[0] == 1 and n < self.row_gemv_max_n and k <= self.decode_w8a8_max_k \
    and k % 128 == 0
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    alternate b1_int8_plain b1_int8_pdl "$ON" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization int8
    ;;
  int8bits)  # int8 codes to fp32 through their float bits in the one-row GEMV (the o projection of a lone
    # decode row; `row_gemv_w8._INT8_BITS`, on since the 53rd session) against Triton's conversion (`I2F`,
    # a quarter of the FMA rate): its GPU tests, int8 batch 1 alternating (REPS_LIST), then the step's
    # critical path with each (`decode_step_profile.py`, INT8_BITS=1|0)
    python -m pytest -q -p no:cacheprovider tests/kernels/test_row_gemv_w8.py tests/kernels/test_w8a8_kernels.py \
      -k "row" 2>&1 | tail -3
    python -m pytest -q -p no:cacheprovider tests/quantization/test_w8a8_gpu.py -k "int8" 2>&1 | tail -3
    OFF="import os, sys; os.environ['TRITON_CACHE_DIR'] = '/tmp/triton_i2f'
import triton.language as tl; import qwick.kernels.row_gemv_w8 as R; R._INT8_BITS = tl.constexpr(False)
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    alternate b1_int8_bits b1_int8_i2f "$OFF" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization int8
    for b in 1 0; do
      QUANT=int8 INT8_BITS=$b BATCHES= OUT=$OUT timeout 200 python benchmarks/decode_step_profile.py \
        >"$OUT/int8bits_prof_$b.log" 2>&1
      echo "== int8 INT8_BITS=$b"
      sed -n '/what each launch adds/,$p' "$OUT/int8bits_prof_$b.log" | head -10 | cut -c1-150
    done
    ;;
  stepends)  # the kernels between two batch-1 graphs: the greedy argmax in two Triton launches
    # (`kernels.sampling.greedy_argmax`; torch's reduction took 9.3 us on an H100) and the in-flight token
    # patch in one (`kernels.token_patch`, its slots uploaded once while they stay the same) against
    # torch's argmax and its gather, cast and scatter after two uploads: their GPU tests, then int8 and fp8
    # batch 1 alternating (REPS_LIST; fp8 once)
    python -m pytest -q -p no:cacheprovider tests/kernels/test_sampling.py tests/kernels/test_token_patch.py 2>&1 \
      | tail -3
    python -m pytest -q -p no:cacheprovider tests/runner/test_no_compiles_while_serving.py -k "int8 or None" \
      2>&1 | tail -3
    OLD="import sys, torch
from qwick.device_upload import to_device
from qwick.runner.model_runner import ModelRunner
from qwick.runner.sampler import Sampler
Sampler._argmax = staticmethod(lambda logits: logits.argmax(dim=-1))
def _patch(self, dst, src):
    if not dst:
        return None
    dst_dev, src_dev = to_device(dst, torch.long, self.device), to_device(src, torch.long, self.device)
    prev = self._prev_sampled
    return lambda ids: ids.index_copy_(0, dst_dev, prev.index_select(0, src_dev).to(ids.dtype))
ModelRunner._patch = _patch
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    alternate b1_int8_new b1_int8_old "$OLD" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization int8
    REPS_LIST=1 alternate b1_fp8_new b1_fp8_old "$OLD" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT \
      --quantization fp8
    ;;
  headgraph)  # tried in the 54th session and lost (int8 341.8 against 349.2, fp8 334.0 against 346.1 on
    # an H100; commit `c65af85`, reverted): the decode graphs holding the LM head behind
    # the final norm. Now: the one int64 conversion (`DecodeGraphRunner._forward`) against the three before
    # it, and the LM head captured after the final norm, as `compute_logits` runs it (quantizing launch
    # first, so not early behind the norm), int8 batch 1 round-robin (REPS_LIST). 56th session, an H100, one
    # run each: the default 349.9, three conversions 349.1, the head in the graph 341.4 (-2.4%)
    OLD="import sys
from qwick.forward_context import set_forward_context
from qwick.runner.cuda_graphs import DecodeGraphRunner as G
def _forward(self, bs, md):
    v = self._views(bs)
    md.slot_mapping = v['slots'].long()
    with set_forward_context(md):
        return self.model(v['ids'].long(), v['pos'].long())
G._forward = _forward
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    HEAD="import sys
from qwick.models.decoder import DecoderForCausalLM as D
from qwick.runner.cuda_graphs import DecodeGraphRunner as G
forward, logits = G._forward, D.compute_logits
G._forward = lambda self, bs, md: self.model.compute_logits(forward(self, bs, md))
D.compute_logits = lambda self, h: h if h.shape[-1] == self.config.vocab_size else logits(self, h)
from qwick.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    for i in ${REPS_LIST:-1 2}; do
      run "b1_int8_conv1_$i" $CLI bench latency --num-iters 3 --shape qwen2.5-7b $SHORT --quantization int8 \
        --output-json "$OUT/b1_int8_conv1_$i.json"
      run "b1_int8_conv3_$i" python -c "$OLD" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT \
        --quantization int8 --output-json "$OUT/b1_int8_conv3_$i.json"
      run "b1_int8_headin_$i" python -c "$HEAD" bench latency --num-iters 3 --shape qwen2.5-7b $SHORT \
        --quantization int8 --output-json "$OUT/b1_int8_headin_$i.json"
    done
    ;;
  headprof)  # why the LM head inside the decode graph lost (54th session): int8's batch-1 critical path
    # with the head after the replay (the default) and captured after the final norm (HEAD_IN_GRAPH=1)
    for h in 0 1; do
      QUANT=int8 HEAD_IN_GRAPH=$h BATCHES= OUT=$OUT timeout 200 python benchmarks/decode_step_profile.py \
        >"$OUT/prof_head$h.log" 2>&1
      echo "== head in graph: $h"; grep -E "median|replay|compute_logits" "$OUT/prof_head$h.log"
      sed -n '/what each launch adds/,$p' "$OUT/prof_head$h.log" | head -24
    done
    ;;
  int4diag)
    python benchmarks/int4_stream_diag.py "$OUT/int4_stream_diag.json" 2>&1 | tee "$OUT/int4_stream_diag.log"
    ;;
  *)
    echo "usage: $0 kernels|tests|latency|targets|fusedsweep|long|tput|models|attn|profile|decode8|int4|order|rope|w3prof|gaps|defer|pairs|int4diag|half2sass|widetiles|tilewarps|ring|staged|stagedab|qkvshape|int4coreside|recipcodes|fused33|fused33ab|fused33quick|fused33bf16|normedfix|pdl36|pdlmlp|w8chain|attnpreload|fp8pdl|int8pdl|int8bits|stepends|headgraph|headprof|tiles32|w8row|int4shapes|int8row|kvlayout|outrows|outrows_ab|outrows_fix|outrows_rev|outrows_w3|w3hf|hfrows|longprefill|next|next2|shortgraphs|lmhead|headdefault|stage3ttft|int4head|w3kv|shortdecode|int4mid|int4mid_e2e|int4tiles|int4small_e2e|int4pipe_e2e|int4ttft|int4models|int4half" >&2
    exit 2
    ;;
esac
