#!/usr/bin/env bash
# The one run on a GPU machine for issue 34, items 4-6, from the repository root:
#
#   OUT=/some/dir bash bench/gpu_step/device_check.sh            on the GPU machine
#   OUT=/tmp/x bash bench/gpu_step/device_check.sh --dry-run      here: the CPU-side rehearsal
#
# In order, each part bounded by `timeout` and by the whole run's budget (BUDGET_S, 470 s:
# a part that would run past it gets what is left, or is skipped under 20 s),
# each failure logged and the next part run all the same:
#   1. nvidia-smi and the software (torch, numpy, hivemind from the carried wheels);
#   2. the GPU benchmark: python -m bench.gpu_step (tiny, small, medium x 1, 2 stages x
#      baseline / fused / compiled), its JSON and plot;
#   3. the GPU test tier: pytest -m gpu tests/gpu;
#   4. the issue's 2 x 2 swarm: swarm-node local --device cuda --model small --stages 2
#      --replicas 2 --seq-len 512 --steps 200, then the same with --compile (tokens/s).
# What comes back ($OUT, at most 8 files): summary.txt (every part's exit status, time and
# last lines, and the headline figures), gpu_step.json, gpu_step.png, swarm-eager.json,
# swarm-compiled.json, logs.tar.gz (every log, the nodes' included, no weights).
#
# The machine has Python 3.12 with torch, numpy, transformers, pytest but no hivemind: its
# wheels and those of its dependencies the image lacks travel in .whl/ and go to /tmp/site.
# The project runs from source (PYTHONPATH), never pip-installed (it says Python 3.11).
set -u
if [[ "${1:-}" != "--dry-run" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    DRY=0; PY=python3
else
    export PYTHONPATH=$PWD
    DRY=1; PY=${PY:-.venv/bin/python}
fi
: "${OUT:?set OUT to the folder whose files come back}"
mkdir -p "$OUT/logs"
LOGS="$OUT/logs"
SUMMARY="$OUT/summary.txt"
BUDGET_S=${BUDGET_S:-470}
START=$(date +%s)

note() { echo "[$(( $(date +%s) - START )) s] $*" | tee -a "$SUMMARY"; }

# step NAME LIMIT_S COMMAND...: run it with its output in logs/NAME.log, at most LIMIT_S
# seconds and never past the budget; its exit status and last lines go to the summary.
step() {
    local name=$1 limit=$2; shift 2
    local left=$(( BUDGET_S - ($(date +%s) - START) ))
    (( left < limit )) && limit=$left
    if (( limit < 20 )); then note "$name: skipped, the budget is spent"; return 0; fi
    note "$name: start, at most ${limit} s: $(echo "$*" | head -c 300 | tr '\n' ' ')"
    local began=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    note "$name: exit $rc after $(( $(date +%s) - began )) s$( (( rc == 124 || rc == 137 )) && echo ' (timed out)')"
    tail -n "${TAIL:-15}" "$LOGS/$name.log" | sed 's/^/    /' >> "$SUMMARY"
    return 0
}

note "device check on ${HOSTNAME:-?}, dry run: $DRY, budget ${BUDGET_S} s"

# 1. the machine and the software
step nvidia-smi 20 nvidia-smi
step software 60 "$PY" -c '
import platform, sys, numpy, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "numpy", numpy.__version__, "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0),
          round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1), "GiB")
for name in ("hivemind", "transformers", "google.protobuf", "pydantic", "msgpack", "uvloop", "pytest"):
    try:
        module = __import__(name, fromlist=["x"])
        print(name, getattr(module, "__version__", "?"), module.__file__)
    except Exception as exc:
        print(name, "MISSING:", type(exc).__name__, exc)
import swarm_node.net.dht, swarm_node.local, swarm_node.train.compiled  # the node, its DHT, --compile
print("swarm_node imports: ok")
'
step version 30 "$PY" -m swarm_node --version

# 2. the GPU benchmark
if (( DRY )); then
    step bench 120 "$PY" -m bench.gpu_step --device cpu --quick --out-dir "$OUT"
else
    TAIL=40 step bench 150 "$PY" -m bench.gpu_step --out-dir "$OUT"
fi

# 3. the GPU test tier (skipped without CUDA, as in the dry run)
TAIL=30 step gpu-tier 170 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider -rfEs --durations=0 --timeout 160

# 4. the issue's 2 x 2 swarm on the card, eager then compiled
if (( DRY )); then
    SWARM=(--device cpu --model debug --stages 1 --replicas 1 --seq-len 64 --steps 10 --data synthetic)
else
    SWARM=(--device cuda --model small --stages 2 --replicas 2 --seq-len 512 --steps 200)
fi
for kind in eager compiled; do
    extra=(); [[ $kind == compiled ]] && extra=(--compile)
    limit=90; [[ $kind == compiled ]] && limit=150  # four nodes compile at start-up
    (( DRY )) && limit=60  # inductor on these CPUs takes minutes: the dry run sees its time-out path
    DMON=
    if (( ! DRY )) && command -v nvidia-smi >/dev/null; then  # the card's use while the swarm runs
        timeout "$limit" nvidia-smi dmon -s um -d 5 > "$LOGS/dmon-$kind.log" 2>&1 &
        DMON=$!
    fi
    step "swarm-$kind" "$limit" "$PY" -m swarm_node local "${SWARM[@]}" "${extra[@]}" --no-progress \
        --run-dir "$LOGS/swarm-$kind" --json-out "$OUT/swarm-$kind.json"
    [[ -n $DMON ]] && kill "$DMON" 2>/dev/null
done

# the headline figures
"$PY" - "$OUT" >> "$SUMMARY" 2>&1 <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
bench = out / "gpu_step.json"
if bench.exists():
    result = json.loads(bench.read_text())
    s = result["summary"]
    print(f"bench: {s.get('device_name')}: {s.get('measured_peak_tflops', 0):.0f} TFLOP/s measured, spec "
          f"{s.get('spec_peak_tflops')}, flash attention {s.get('flash_attention')}")
    for row in result["rows"]:
        print(f"  {row['size']:>6} {row['stages']} stage(s) s{row['stage']} {row['mode']:<8} "
              f"{row['tokens_per_s']:>10,.0f} tok/s MFU {100 * row['mfu_measured']:.1f} % "
              f"(spec {100 * (row['mfu_spec'] or 0):.1f} %) peak/estimate {row['peak_over_estimate']} "
              f"compile {row['compile_s']}")
    for key, by_mode in s.get("pipeline_tokens_per_s", {}).items():
        print(f"  pipeline {key}: {by_mode}")
for kind in ("eager", "compiled"):
    path = out / f"swarm-{kind}.json"
    if not path.exists():
        print(f"swarm {kind}: no summary")
        continue
    d = json.loads(path.read_text())
    print(f"swarm {kind}: {d['tokens_per_s'] or 0:,.0f} tokens/s ({d['tokens']:,} tokens in {d['wall_s']:.1f} s), "
          f"eval on {d.get('eval_device')} in {d['eval_s']:.1f} s, val loss {d['initial_val_loss']} -> "
          f"{d['final_val_loss']}, dead {d.get('dead_nodes')}")
    for p in d["peers"]:
        print(f"  stage {p['stage']} {p['status']}: {p['inner_steps']} steps, {p['rounds_with_partner']}/"
              f"{p['outer_rounds']} rounds paired, {p['microbatches_done']} micro-batches, "
              f"{p['microbatches_lost']} lost, {p['bytes_sent'] / 1e6:.0f} MB sent")
EOF

# everything else in one file: logs, node logs and metrics, no weights
tar czf "$OUT/logs.tar.gz" -C "$OUT" --exclude='*.pt' --exclude='*.pt.tmp' logs && rm -rf "$LOGS"
note "done; files: $(cd "$OUT" && ls | tr '\n' ' ')"
