#!/usr/bin/env bash
# The routed experts on one H200 in one device call: GPU tests, then benchmarks/moe_experts.py in steps, each with
# its own time limit (a slow step cannot take the others' results with it); logs and JSON land in $OUT.
#   run(carry=[...], command="bash benchmarks/moe_experts_h200.sh")
# STEPS picks steps (default: all); T_<STEP> overrides a step's seconds. The bf16 and mxfp4 steps merge their
# measured picks into $OUT/h200.json, a copy of k3compile/ops/moe_experts/tables/h200.json (copy it back to use
# them); they compile their swept configurations in 8 processes first ("prewarm:" in their logs). AUTOTUNE_BUDGET
# bounds each max-autotune compile (seconds per M; past it that provider is skipped, the log says so). Without an
# installed checkout, the package mapping of setup.py is made with two links (k3compile/model, k3compile/patterns)
# and PYTHONPATH.
set -u
OUT=${OUT:-moe_out}; mkdir -p "$OUT"
cp k3compile/ops/moe_experts/tables/h200.json "$OUT/h200.json"
export PYTHONUNBUFFERED=1
HERE=$(python -c 'import k3compile, os; print(os.path.dirname(os.path.dirname(k3compile.__file__)))' 2>/dev/null)
if ! python -c "import k3compile.model, k3compile.patterns" 2>/dev/null || [ "$HERE" != "$PWD" ]; then
    ln -sfn ../model k3compile/model; ln -sfn ../patterns k3compile/patterns; export PYTHONPATH=$PWD
fi
python -c "import torch, triton, k3compile as k; print(torch.__version__, triton.__version__, k.__file__)"
STEPS=${STEPS:-tests bf16 mxfp4 tp16 autotune}
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    echo "=== $name (limit ${secs}s)"
    local t0=$SECONDS
    timeout --kill-after=10 "$secs" "$@" > "$OUT/$name.log" 2>&1
    echo "=== $name: rc=$? in $((SECONDS - t0))s"
}
B=benchmarks/moe_experts.py
step tests    ${T_TESTS:-150}   python -m pytest -q -m gpu -p no:cacheprovider -rf tests/ops/test_moe_experts.py \
                               tests/patterns/test_moe_experts.py ${TESTS_K:+-k "$TESTS_K"}
step bf16     ${T_BF16:-120}   python $B --tp 8 --formats bf16 --sweep-m ${SWEEP_M:-1 4 16} \
                               --kernels-m ${KERNELS_M:-1 16} --compile-m ${COMPILE_M:-1 8 256} \
                               --json "$OUT/bf16.json" --table "$OUT/h200.json" --svg "$OUT/bf16.svg"
step mxfp4    ${T_MXFP4:-90}   python $B --tp 8 --formats mxfp4 --sweep-m ${SWEEP_M_MX:-1 16} --kernels-m 1 \
                               --compile-m 8 --skewed-m --json "$OUT/mxfp4.json" --table "$OUT/h200.json"
step tp16     ${T_TP16:-40}    python $B --tp 16 --formats bf16 mxfp4 --m 1 8 16 --compile-m --skewed-m \
                               --json "$OUT/tp16.json"
step autotune ${T_AUTOTUNE:-120} python $B --tp 8 --formats bf16 --m ${AUTOTUNE_M:-1 8} \
                               --autotune-m ${AUTOTUNE_M:-1 8} --compile-m ${AUTOTUNE_M:-1 8} --skewed-m \
                               --autotune-budget ${AUTOTUNE_BUDGET:-45} --json "$OUT/autotune.json"
for f in $STEPS; do   # headline rows: format, routing, M, provider, us, % of floor, rel err (all in $OUT/<step>.*)
    [ -f "$OUT/$f.log" ] && { echo "----- $f"; grep -E "passed|failed|Error|prewarm|compiled and checked|budget" \
        "$OUT/$f.log" | tail -6; sed -n '/all rows/,$p' "$OUT/$f.log" \
        | awk '$7 ~ /^(k3|k3:.*|k3\[.*\]|compile|max-autotune|dense)$/ {
               printf "%-5s %-6s %4s %-64s %8s %7s %s\n", $2, $3, $4, $7, $8, $9, $12 }' | tail -n ${TAIL:-60}; }
done
