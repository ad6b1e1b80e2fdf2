"""How ``dispatch_decisions_3eb5bb7.json.xz`` was made: every dispatch decision of commit 3eb5bb7 (the tables still
in Python), as strings ``backend=impl:config-tag``. It imports that commit's modules, so it runs against a checkout
of it only (``git archive 3eb5bb7 | tar -x -C /tmp/old && PYTHONPATH=/tmp/old python this.py OUT.json.xz``); kept
to show what ``test_dispatch_decisions.py`` compares with."""
import dataclasses, json, lzma, sys
import torch
import k3compile.backends as B
from k3compile.ops.skinny_gemm import op as gop, config as gcfg, cute as gcute
from k3compile.ops.skinny_gemm import triton as gtri
from k3compile.ops.skinny_gemm.triton_config import choose_config
from k3compile.ops.latent_moe_tail import op as top, triton as ttri, cute as tcute, split as tsplit

class FakeT:
    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device(device)
        st, acc = [], 1
        for s in reversed(shape):
            st.append(acc); acc *= max(s, 1)
        self._stride = tuple(reversed(st))
    def dim(self): return len(self.shape)
    def stride(self, i=None): return self._stride if i is None else self._stride[i]
    def data_ptr(self): return 0
    def element_size(self): return torch.empty((), dtype=self.dtype).element_size()
    def is_contiguous(self): return True

def env(kind):
    """kind: 'h200' (sm_90, 132 SMs, cutlass), 'sm114' (sm_90, 114 SMs, cutlass), 'cpu' (interpreter)."""
    dev = "cpu" if kind == "cpu" else "cuda"
    sms = {"h200": 132, "sm114": 114, "cpu": 0}[kind]
    ok = lambda *a, **k: None
    no = lambda *a, **k: "not here"
    G, T = gop.SKINNY_GEMM, top.LATENT_MOE_TAIL
    G.cute = dataclasses.replace(G.cute, available=no if dev == "cpu" else ok)
    G.triton = dataclasses.replace(G.triton, available=ok)
    T.cute = dataclasses.replace(T.cute, available=no if dev == "cpu" else ok)
    T.triton = dataclasses.replace(T.triton, available=ok)
    ttri.pdl_capable = lambda device: device.type == "cuda"
    top.fused_profitable.__globals__["pdl_capable"] = ttri.pdl_capable
    return dev, sms

def gemm_config(impl, a, w, static, sms):
    m, k = a.shape; n = w.shape[0]
    if impl == "cute":
        return gcute.pick(a, w, None, None, static).tag()
    if impl == "triton":
        cfg = choose_config(m, n, k, sms, static)
        if cfg.early_trigger and a.element_size() > 2:
            cfg = dataclasses.replace(cfg, early_trigger=False, num_stages=None)
        return cfg.tag()
    return ""

def gemm(backend, m, n, k, dtype, static, dev, sms, bias=False, residual=True, m_limit=16):
    a, w = FakeT((m, k), dtype, dev), FakeT((n, k), dtype, dev)
    b = FakeT((n,), dtype, dev) if bias else None
    r = FakeT((m, n), dtype, dev) if residual else None
    if m > m_limit:
        return "aten:"
    try:
        impl, _ = gop.SKINNY_GEMM._decide(backend, (a, w, b, r))
    except B.BackendUnavailableError:
        return "raises:"
    return f"{impl}:{gemm_config(impl, a, w, static, sms)}"

def tail(backend, m, d, l, dtype, static, dev, sms, limit=16):
    lat, sh, g, w = FakeT((m, l), dtype, dev), FakeT((m, d), dtype, dev), FakeT((l,), dtype, dev), FakeT((d, l), dtype, dev)
    try:
        impl, _ = top.LATENT_MOE_TAIL._decide(backend, (lat, sh, g, w, 1e-5, limit))
    except B.BackendUnavailableError:
        return "raises:"
    if impl == "cute":
        return "cute:" + tcute.tail_config(m, d, l, static).tag()
    if impl == "triton":
        why = top.fused_profitable(lat, w, static_weight=static)
        if why is None:
            return "triton:" + ttri.default_config(m, d, l, dtype, sms, static).tag()
        sc = tsplit.split_config(m, d, l, dtype, dev == "cuda")
        assert sc == tsplit.SplitConfig(), sc
        return "split:" + gemm(backend, m, d, l, dtype, True, dev, sms, residual=True, m_limit=limit)
    return impl + ":"

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GEMM_N = (64, 384, 777, 896, 1024, 1536, 2048, 2112, 2304, 3584, 4096, 4608, 7168, 12288, 20480)
GEMM_K = (64, 768, 1000, 1004, 1536, 2048, 3584, 4096, 7168, 8192)
TAIL_D = (1024, 2048, 4096, 7168)
TAIL_L = (512, 1000, 1536, 2048, 3584, 7168)
M_ALL = tuple(range(1, 18))
M_FEW = (1, 2, 3, 4, 5, 8, 9, 16, 17)

def main(out):
    rec = {}
    for kind in ("h200", "sm114", "cpu"):
        dev, sms = env(kind)
        mlist = M_ALL if kind == "h200" else M_FEW
        for dn, dt in DT.items():
            for m in mlist:
                for st in (False, True):
                    for n in GEMM_N:
                        for k in GEMM_K:
                            rec[f"{kind} skinny_gemm {dn} M{m} N{n} K{k} s{int(st)}"] = " ".join(
                                f"{be}={gemm(be, m, n, k, dt, st, dev, sms)}" for be in ("auto", "cute", "triton"))
                    for d in TAIL_D:
                        for l in TAIL_L:
                            rec[f"{kind} latent_moe_tail {dn} M{m} N{d} K{l} s{int(st)}"] = " ".join(
                                f"{be}={tail(be, m, d, l, dt, st, dev, sms)}" for be in ("auto", "cute", "triton"))
    with lzma.open(out, "wt") as f:
        json.dump(rec, f, indent=0, sort_keys=True)
    print(len(rec))

if __name__ == "__main__":
    main(sys.argv[1])
