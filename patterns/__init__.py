"""The k3 graph rewrites, one file per pattern (contract: ``patterns/_common.py``).

``PASS_ORDER`` is the order the pass manager applies them in. Order matters where two passes could
claim the same nodes: the latent-MoE tail consumes its up-projection ``mm`` before the skinny-GEMM
pass would turn it into ``k3::skinny_gemm``, the routed experts are claimed whole before their products are
considered, the KDA decode step is claimed whole before its
projections are considered, and a product of an upcast 16-bit weight is claimed with its casts before the
skinny-GEMM pass would take the fp32 ``mm`` alone; the residual adds left before the AttnRes mixes are folded
into them after the skinny-GEMM pass has taken those it fuses into a product; a MoE layer's routing joins a product
of its input, and its routed experts its shared experts' chain, in one op each after every rewrite has made them;
then the small products left of an input go beside its large ones.
"""
PASS_ORDER: tuple[str, ...] = (
    "latent_moe_tail",  # first: takes its up-projection mm before skinny_gemm would
    "moe_experts",  # before skinny_gemm: on a GPU the dense form's batch-1 bmm's are mm's it would claim
    "moe_route",  # the routing tail after the router's product (no mm inside)
    "attn_res",  # the Block AttnRes mixes and their norms (no mm inside)
    "kda_decode",  # before skinny_gemm: the KDA step is claimed whole before its projections are considered
    "kda_prefill",  # the prefill recurrence (no mm of its own; placed beside the decode step)
    "mla_decode",  # the MLA attention of a decode step (bmm only: no skinny_gemm candidate inside)
    "upcast_matmul",  # before skinny_gemm: takes linear(x.float(), w.float()) on the 16-bit weight, cast and all
    "skinny_gemm",  # claims the GEMMs no earlier pass fused
    "attn_res_add",  # after skinny_gemm: a residual add a product takes as its residual stays the product's
    "route_beside",  # folds a routing with a product of its input, both k3 ops by then
    "experts_beside",  # folds the routed experts with the shared experts' chain, k3 ops by then
    "products_beside",  # last: an input's small products beside its large ones, of the products no fold took
)
