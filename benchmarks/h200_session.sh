#!/usr/bin/env bash
# One device call that checks and times everything GPU-side on the lent GPUs (the figures in the notes):
#   run(kind="nvidia-h200-x2", carry=[".gpu-deps"],
#       command="source .gpu-deps/activate.sh && bash benchmarks/h200_session.sh")
# Single-GPU steps use GPU 0; the --tp 2 step needs two GPUs (skipped with one). Each step has its own time
# limit so a slow step cannot take the others' results with it; logs and JSON land in $OUT (or ./h200_out).
set -u
OUT=${OUT:-h200_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the image's torch stays; k3compile.model / k3compile.patterns need the package-dir mapping of setup.py
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || tail -5 "$OUT/install.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.device_count(), 'x', torch.cuda.get_device_name())"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
# the lent card may be an H100 or an H200: the result files carry the card they ran on (h100, h200, ...)
CARD=$(python3 -c "import torch; n = torch.cuda.get_device_name().lower(); print(next((c for c in ('h100', 'h200', 'b200', 'a100', 'mi300') if c in n), 'gpu'))")
STEPS=${STEPS:-gpu_tests gpu_model kda_decode kda_prefill moe_tail moe_tail_tp2 skinny decode_tp1 attn_res attn_res_add moe_cute moe_cute_tune router_sweep mla_tune mla_tune_len mla_decode}
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    echo "=== $name (limit ${secs}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$secs" "$@" > "$OUT/$name.log" 2>&1
    echo "=== $name: rc=$? in $((SECONDS - t0))s"
}
step gpu_tests    ${T_TESTS:-150} python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/ops tests/patterns ${TESTS_K:+-k "$TESTS_K"}
step gpu_model    ${T_MODEL:-240} python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/compiler/test_gpu_k3.py ${MODEL_K:+-k "$MODEL_K"}
step kda_decode   ${T_KDA:-130}   python3 benchmarks/kda_decode.py --rep-ms 50 --out "$OUT/kda_decode.json"
step kda_prefill  ${T_KDAP:-40}   python3 benchmarks/kda_prefill.py --tokens 512 4096 --heads 12 --rep-ms 40 \
                                  --out "$OUT/kda_prefill.json"
step moe_tail     ${T_MOE:-110}   python3 benchmarks/moe_tail.py --m 1 2 4 8 16 --json "$OUT/moe_tail_tp1.json"
[ "$NGPU" -ge 2 ] && step moe_tail_tp2 ${T_MOE2:-100} python3 benchmarks/moe_tail.py --tp 2 --m 1 4 16 --json "$OUT/moe_tail_tp2.json"
step skinny       ${T_SKINNY:-300} python3 benchmarks/skinny_gemm.py --json "$OUT/skinny_gemm_$CARD.json" \
                                  --png "$OUT/skinny_gemm_$CARD.png"
step decode_tp1   ${T_DECODE:-120} python3 benchmarks/tp_decode.py --world-size 1 --backend nccl --config slice \
                                  --batch 1,16 --steps 3 --json "$OUT/decode_tp1.json"
# the CuTe MoE kernels' GPU tests alone (a fresh machine builds every kernel: the whole gpu_tests step takes > 200 s;
# this file alone ~4 s a test, 70 of its fixed tests took 270 s on a fresh H200)
step moe_cute_tests ${T_MOE_CUTE_TESTS:-420} python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
                                  tests/ops/test_moe_experts_cute.py
# not in the default STEPS (8 cases): TP 16's own picks (I 192) against the reference: STEPS=moe_cute_tests16
step moe_cute_tests16 ${T_MOE_CUTE_TESTS16:-150} python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
                                  tests/ops/test_moe_experts_cute.py -k "test_gpu_matches_reference and 192"
# a Block AttnRes mix and its norm: k3::attn_res against torch.compile of the model's code (K3's width, 2-9 sources)
step attn_res     ${T_ATTN_RES:-90} python3 benchmarks/attn_res.py --json "$OUT/attn_res_$CARD.json"
# ... with the residual add before it: the add's kernel then k3::attn_res against k3::attn_res_add
step attn_res_add ${T_ATTN_RES_ADD:-90} python3 benchmarks/attn_res.py --add --json "$OUT/attn_res_add_$CARD.json"
# the routed experts with MXFP4 weights: the op (CuTe kernels at M <= 16) against the Triton kernels, then the CuTe
# kernels' work divisions alone (their picks live in k3compile/ops/moe_experts/cute.py)
step moe_cute     ${T_MOE_CUTE:-240} python3 benchmarks/moe_experts.py --m 1 2 4 8 12 16 --tp 8 16 --formats mxfp4 \
                                  --compile-m 1 8 --kernels-m 1 8 --skewed-m 8 --json "$OUT/moe_experts_mxfp4_cute_$CARD.json"
step moe_cute_tune ${T_MOE_CUTE_TUNE:-150} python3 benchmarks/tune_moe_experts_cute.py 384
# not in the default STEPS (about 3 minutes): TP 16's widths (I 192: its own down picks), every compact form with the
# loads ahead too: STEPS=moe_cute_tune16
step moe_cute_tune16 ${T_MOE_CUTE_TUNE16:-240} python3 benchmarks/tune_moe_experts_cute.py 192 --compact-only --ahead
# the router's product and the routing kernel in their decode-step chain, per Triton configuration and PDL launch
step router_sweep ${T_ROUTER:-150} python3 benchmarks/upcast_router.py --sweep --ms 1,8 --json "$OUT/router_sweep.json"
# the MLA decode layout table first (written into the tree, so the benchmark's dispatch reads it), then the sweep
step mla_tune     ${T_MLA_TUNE:-150} python3 benchmarks/tune_mla_decode.py --out "$OUT/mla_decode_table_$CARD.json" \
                                  --log "$OUT/mla_tune_log.json"
# stage 3 on the table stage 1-2 just wrote: layouts by length at batch 1 and 8 (it rewrites the table in the tree)
step mla_tune_len ${T_MLA_TUNE_LEN:-200} python3 benchmarks/tune_mla_decode.py --by-length \
                                  --out "$OUT/mla_decode_table_$CARD.json" --log "$OUT/mla_tune_len_log.json" \
                                  --length-json "$OUT/mla_by_length_$CARD.json"
step mla_decode   ${T_MLA:-240}   python3 benchmarks/mla_decode.py ${MLA_ARGS:-} --out "$OUT/mla_decode_$CARD.json"
# not in the default STEPS (about 6 minutes): STEPS=decode_step
step decode_step  ${T_STEP:-460}  python3 benchmarks/decode_step.py --tp 8 --layers 4 --batch 1,8 --context 1024 \
                                  --providers eager,compile,optimize --json "$OUT/decode_step.json" \
                                  --plot "$OUT/decode_step.svg"
# not in the default STEPS (about 6 minutes): STEPS=decode_step_mxfp4
step decode_step_mxfp4 ${T_STEP_MX:-300} python3 benchmarks/decode_step.py --tp 8 --layers 4 --experts mxfp4 \
                                  --batch 1,8 --context 1024 --providers compile,optimize \
                                  --json "$OUT/decode_step_mxfp4_$CARD.json"
# not in the default STEPS (about 2 and 4 minutes): a TP 16 rank's 4-layer step, whole graph then regions; all 93
# layers of a TP 16 rank (108 GB of weights, regions: optimize()'s default at this depth), M 1 then M 8:
# STEPS="decode_tp16 decode_93"
step decode_tp16  ${T_STEP16:-300} python3 benchmarks/decode_step.py --tp 16 --layers 4 --experts mxfp4 \
                                  --batch 1,8 --context 1024 --providers compile,optimize \
                                  --json "$OUT/decode_step_mxfp4_tp16_$CARD.json"
step decode_93    ${T_STEP93:-560} python3 benchmarks/decode_step.py --tp 16 --layers 93 --experts mxfp4 \
                                  --batch 1,8 --context 1024 --providers optimize --reference optimize --regions \
                                  --steps 2 --replays 5 --profile-steps 1 \
                                  --json "$OUT/decode_step_mxfp4_tp16_93_$CARD.json"
# not in the default STEPS (about 6 minutes): the decode step's prepared orderings (docs/tuning/decode_step.md), the
# PDL ordering tests first, then the MXFP4 step at M 1 as it is, with Inductor's kernels triggering without a PDL
# launch, with the same-input products ordered, and with both: STEPS="trigger_order decode_ab"
step trigger_order ${T_TRIGGER_ORDER:-60} python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
                                  tests/compiler/test_pdl_ordering.py
case " $STEPS " in *" decode_ab "*) STEPS="$STEPS ab_base ab_trigger ab_order ab_both" ;; esac
for ab in "base K3_INDUCTOR_PDL=0" "trigger K3_INDUCTOR_PDL=trigger" "order K3_ORDER_PRODUCTS=1" \
          "both K3_INDUCTOR_PDL=trigger K3_ORDER_PRODUCTS=1"; do
    set -- $ab
    name=$1; shift
    step ab_$name ${T_AB:-100} env "$@" python3 benchmarks/decode_step.py --tp 8 --layers 4 --experts mxfp4 \
                                  --batch 1 --context 1024 --providers optimize --profile-steps 1 \
                                  --json "$OUT/decode_step_ab_$name.json"
done
# not in the default STEPS (about 5 minutes): a second-stream fold (BESIDE_PASS: route_beside, the routing beside the
# latent product; experts_beside, the routed experts beside the shared chain) against its chains in turn, interleaved
# twice, at a TP 8 rank (BESIDE_TP=16: TP 16's): STEPS=beside_ab
case " $STEPS " in *" beside_ab "*) STEPS="$STEPS beside_1 inturn_1 beside_2 inturn_2" ;; esac
BESIDE_PASS=${BESIDE_PASS:-experts_beside}
for ab in "beside_1" "inturn_1 --without-passes $BESIDE_PASS" "beside_2" "inturn_2 --without-passes $BESIDE_PASS"; do
    set -- $ab
    name=$1; shift
    step $name ${T_AB:-100} python3 benchmarks/decode_step.py --tp ${BESIDE_TP:-8} --layers 4 --experts mxfp4 \
                                  --batch 1,8 --context 1024 --providers optimize --reference optimize \
                                  --profile-steps 0 --replays 40 "$@" --json "$OUT/decode_step_$name.json"
done
# not in the default STEPS (about 2 minutes on a fresh machine): the routed experts beside the shared chain, the op
# against itself in turn and each half alone, TP 16's shapes: STEPS=experts_beside
step experts_beside ${T_BESIDE:-150} python3 benchmarks/experts_beside.py --tp ${BESIDE_TP:-16} \
                                  --json "$OUT/experts_beside_$CARD.json"
# not in the default STEPS (about a minute): a KDA layer's small products beside its large ones, the op against itself
# in turn, the side chain through each backend, TP 8 and 16 shapes: STEPS=products_beside
step products_beside ${T_PRODUCTS:-120} python3 benchmarks/products_beside.py --json "$OUT/products_beside_$CARD.json"
# not in the default STEPS (about 5 minutes, fresh caches in each child): STEPS=compile_time
step compile_time ${T_COMPILE:-560} python3 benchmarks/compile_time.py --device cuda --layers 4 \
                                  --variants torch.compile,optimize-whole,optimize-whole-tritonahead,optimize-regions \
                                  --warm-variants torch.compile,optimize-whole --budget $(( ${T_COMPILE:-560} - 20 )) \
                                  --child-timeout 220 --out "$OUT/compile_time_$CARD.json"
for f in $STEPS; do
    [ -f "$OUT/$f.log" ] && { echo "----- $f (tail)"; tail -n ${TAIL:-22} "$OUT/$f.log"; }
done
