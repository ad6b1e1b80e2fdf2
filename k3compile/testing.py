"""Helpers the test suite (and GPU benchmarks' correctness checks) share."""
import math
import re

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64. A NaN anywhere in ``out`` fails: an unwritten (NaN-poisoned) element or
    bad math must never pass as a large-but-finite error."""
    assert not torch.isnan(out).any(), "NaN in the output (unwritten element or bad math)"
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# per row and step, ||a - b|| / ||b|| over the vocabulary against the fp32 computation; eager bf16 and plain
# torch.compile's bf16 give 0.3-2.2e-2 on the CPU (two bf16 runs differ from each other by up to 2.8e-2)
LOGITS_TOL = 3e-2


def teacher_forced_logits(model, ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, NEW, V] fp32: the prompt's next-token logits, then those after each of ``tokens[:, :-1]`` fed in turn
    (one decode step each, on one cache): every model sees the same inputs, whatever it would have picked itself."""
    B, T = ids.shape
    cache = model.allocate_cache(B, T + tokens.shape[1], device=ids.device)
    # copied at once: under mode="reduce-overhead" the next replay overwrites a CUDA graph's output
    steps = [model(ids, cache=cache, logits_to_keep=1).to(torch.float32, copy=True)]
    steps += [model(tokens[:, i:i + 1], cache=cache, logits_to_keep=1).to(torch.float32, copy=True)
              for i in range(tokens.shape[1] - 1)]
    return torch.cat(steps, dim=1)


def step_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return ((got - want).norm(dim=-1) / want.norm(dim=-1)).cpu()


def assert_within_bf16_noise(model, eager, ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Teacher-forced on ``tokens`` (eager's greedy ones), ``model``'s logits at every step against the same bf16
    weights computed in fp32 (no TF32), within the noise of a correct bf16 computation: eager's and plain
    ``torch.compile``'s. Returns the (row, step) errors.

    Free-running greedy tokens part at the first bf16 near-tie and would hide or fake an error from there on. Where
    eager or plain ``torch.compile`` is itself above the tolerance the step is ill-conditioned in 16 bits, and only
    "no further off than they are" can be asked there. A rounding can also flip a near-tie in a router's top-k, a
    jump no tolerance covers. On the CPU (reference kernels) the kda_prefill rewrite alone moves the first layer's
    KDA inputs by 1.5e-3 (Inductor keeps fp32 where eager rounds); noise of that size flips the experts of 2-3
    tokens a MoE layer (top-k margins down to 5e-4), and the rewritten model was 0.08 and 0.46 off at two of its
    twelve steps where eager and torch.compile were 0.02. On the H200 one of the micro K3's two sequences is
    ill-conditioned at every step (eager bf16 0.03-0.57 off the fp32 computation). So: most steps within the
    allowance, and most of the well-conditioned steps (enough of them to tell) within the tolerance itself; a wrong
    kernel is off at most steps."""
    import copy

    truth = copy.deepcopy(eager).set_dtype(torch.float32)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(allow_tf32=False):
            want = teacher_forced_logits(truth, ids, tokens)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    del truth
    errs = step_errors(teacher_forced_logits(model, ids, tokens), want)
    control = copy.deepcopy(eager)
    torch._dynamo.reset()
    control_errs = step_errors(teacher_forced_logits(torch.compile(control, dynamic=False), ids, tokens), want)
    noise = torch.maximum(step_errors(teacher_forced_logits(eager, ids, tokens), want), control_errs)
    allowed = torch.maximum(torch.full_like(noise, LOGITS_TOL), 2 * noise)
    calm = noise < LOGITS_TOL
    seen = (f"logits off the fp32 computation's (rows x steps):\n{errs}\neager's and plain torch.compile's, the "
            f"further:\n{noise}")
    assert calm.sum() >= 4, f"too few well-conditioned steps to tell a wrong kernel from bf16 noise\n{seen}"
    assert torch.isfinite(errs).all(), seen
    assert (errs < allowed).float().mean() >= 0.75, seen
    assert (errs[calm] < LOGITS_TOL).float().mean() >= 2 / 3, seen
    return errs


_KDA_DECODE_CALL = re.compile(r"torch\.ops\.k3\.kda_decode\.default\(([^)]*)\)")
_KDA_DECODE_MUTATED = (3, 4, 5, 16)   # conv_state_q/k/v, state in k3::kda_decode's schema


def eager_then_optimized(model: torch.nn.Module, *inputs, passes, records=(), backend: str = "triton"):
    """(outputs of ``model`` optimized with ``passes`` on ``inputs``, its eager outputs before, the compiled graph's
    record), from a fresh Dynamo and with each of ``records`` (an op's ``OpImpls``) cleared first: a pattern test's
    one compile."""
    import k3compile

    torch._dynamo.reset()
    for record in records:
        record.clear()
    model.eval()
    with torch.no_grad():
        ref = model(*inputs)
        k3compile.optimize(model, backend=backend, passes=list(passes), dynamic=False)
        out = model(*inputs)
    return out, ref, k3compile.report(model).graphs[0].record


def assert_kda_states_not_copied(code: str) -> int:
    """In Inductor's output ``code``, every state a ``k3::kda_decode`` call mutates is a graph input used by the op
    call alone (and ``del``): no copy of it. Returns the number of calls (the op mutates in place, so only the
    generated code can show that no copy remains)."""
    calls = _KDA_DECODE_CALL.findall(code)
    for call in calls:
        args = [a.strip() for a in call.split(",")]
        for i in _KDA_DECODE_MUTATED:
            name = args[i]
            assert re.fullmatch(r"arg\d+_1", name), f"mutated state {name} is not the graph input itself"
            uses = [line.strip() for line in code.splitlines()
                    if re.search(rf"\b{name}\b", line) and "kda_decode.default(" not in line
                    and not line.strip().startswith(("del ", "#")) and "rand_strided" not in line
                    and not line.strip().startswith(("return [", "args = [", "assert_size_stride"))]
            # the wrapper's unpacking of its inputs and the benchmark harness's argument list
            uses = [u for u in uses if not re.match(r"^[\w, ]+ = args$", u)
                    and not re.match(r"^\w+ = \[\w+(, \w+)*\]$", u)]
            assert not uses, f"state {name} is also used (copied?) by: {uses[:3]}"
    return len(calls)


def check_chain_replays(graph, x: torch.Tensor, out: torch.Tensor, weights: list, max_rel: float,
                        replays: int = 3) -> None:
    """Replay a captured chain of skinny products (each reading the one before: ``x @ w0ᵀ @ w1ᵀ …``) on fresh
    ``x``, ``out`` NaN-poisoned before each replay; it must match the chain rounded to x's dtype after every
    product, as the kernels round (a PDL kernel that read its input before the previous one wrote it fails here)."""
    for _ in range(replays):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = x.double()
        for w in weights:
            ref = (ref @ w.double().T).to(x.dtype).double()
        assert rel_err(out, ref) < max_rel


def latent_moe_tail_inputs(m: int, l: int, d: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0):
    """Random (latent [m, l], shared [m, d], norm weight [l], up weight [d, l]) for the latent-MoE tail, drawn
    on the CPU from ``seed``; ``scale`` multiplies the latent (large values probe fp16 overflow)."""
    g = torch.Generator().manual_seed(seed)
    latent = (torch.randn(m, l, generator=g) * scale).to(dtype)
    shared = torch.randn(m, d, generator=g).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(l, generator=g)).to(dtype)
    up_weight = (torch.randn(d, l, generator=g) / l ** 0.5).to(dtype)
    return latent, shared, norm_weight, up_weight


def ptx_in_a_fresh_process(script: str, flavours: dict) -> dict:
    """Run ``script`` (which compiles kernels with ``triton.compile`` for a GPU target — Triton's NVIDIA backend
    needs no GPU — and prints one JSON line of name -> PTX) on ``json.dumps(flavours)``, in a process without
    ``TRITON_INTERPRET`` (under it nothing is compiled) that imports this checkout of k3compile; returns that JSON."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    run = subprocess.run([sys.executable, "-c", script, json.dumps(flavours)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def moe_experts_inputs(m: int, a: int, e: int, i: int, l: int, dtype: torch.dtype, routing: str = "random",
                       mxfp4: bool = False, seed: int = 0, device="cpu"):
    """Random arguments of ``k3::moe_experts`` drawn on ``device`` from ``seed``: (z [m, l], experts [m, a] int64,
    weights [m, a] fp32, w1, w3, w2, w1_scale, w3_scale, w2_scale).

    ``routing``: "random" (a distinct experts per token, uniform), "skewed" (every token on experts 0..a-1, when
    a <= e), "repeat" (ids drawn with replacement: duplicates within a token), "one" (every pair on expert 0).
    Float weights are scaled so every product is O(1); MXFP4 weights (``mxfp4``: l and i multiples of 32) are
    random codes with E8M0 scales drawn around the same magnitude. Drawn where they are used: K3's experts are
    gigabytes, too slow to draw on a CPU."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    z = randn(m, l).to(dtype)
    if routing == "random":
        experts = torch.stack([torch.randperm(e, generator=g, device=device)[:a] for _ in range(m)]) if m else \
            torch.zeros(0, a, dtype=torch.int64, device=device)
    elif routing == "skewed":
        experts = (torch.arange(a, device=device) % e).repeat(m, 1)
    elif routing == "repeat":
        experts = torch.randint(0, e, (m, a), generator=g, device=device)
    elif routing == "one":
        experts = torch.zeros(m, a, dtype=torch.int64, device=device)
    else:
        raise ValueError(f"routing {routing!r}")
    weights = torch.rand(m, a, generator=g, device=device) + 0.1
    if not mxfp4:
        w1 = (randn(e, i, l) / l ** 0.5).to(dtype)
        w3 = (randn(e, i, l) / l ** 0.5).to(dtype)
        w2 = (randn(e, l, i) / i ** 0.5).to(dtype)
        return z, experts, weights, w1, w3, w2, None, None, None

    def codes(rows, cols):
        return torch.randint(0, 256, (e, rows, cols // 2), dtype=torch.uint8, generator=g, device=device)

    def scale(rows, cols):
        # E2M1 magnitudes average ~2.2: 2^(s-127) ~ 1/(2.2·sqrt(cols)) keeps each product O(1)
        center = 127 - round(math.log2(2.2 * cols ** 0.5))
        return torch.randint(center - 2, center + 3, (e, rows, cols // 32), dtype=torch.uint8, generator=g,
                             device=device)

    return z, experts, weights, codes(i, l), codes(i, l), codes(l, i), scale(i, l), scale(i, l), scale(l, i)


# --------------------------------------------------------------------------------------------------
# A stand-in for CuTe DSL's builds (tests/compiler/test_precompile.py): registered in place of the "cute" kind of
# k3compile/kernel_cache.py, it "builds" a kernel that computes the skinny GEMM's (or the fused tail's) result in
# PyTorch and stores it as a small JSON file. Module-level, so that a precompile worker process unpickles it.

FAKE_FAIL_ENV = "K3_FAKE_BUILD_FAIL"   # a kernel whose name contains this value fails to build (a compiler error)
FAKE_TORN_ENV = "K3_FAKE_BUILD_TORN"   # ... fails half way through writing its file
FAKE_HANG_ENV = "K3_FAKE_BUILD_HANG"   # ... never finishes


def _named_by(env: str, name: str) -> bool:
    value = __import__("os").environ.get(env, "")
    return bool(value) and value in name


class FakeKernel:
    """``fn(a, w, out, bias, residual, g)`` as a compiled CuTe variant is called, for its M only."""

    def __init__(self, name: str, m: int, eps):
        self.name, self.m, self.eps = name, m, eps

    def __call__(self, a, w, out, bias, residual, g):
        assert a.shape[0] == self.m, f"{self.name} called with M={a.shape[0]}"
        x = a.float()
        if self.eps is not None:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * g.float()
        y = x @ w.float().T
        for t in (bias, residual):
            if t is not None:
                y = y + t.float()
        out.copy_(y)


def fake_compile(key) -> FakeKernel:
    import time

    from k3compile.kernels.cute.compile import variant_name

    name = variant_name(key)
    if _named_by(FAKE_FAIL_ENV, name):
        raise RuntimeError("simulated compiler error")
    if _named_by(FAKE_HANG_ENV, name):
        time.sleep(3600)
    return FakeKernel(name, key[1], key[6])


def fake_export(kernel: FakeKernel, path: str, name: str) -> None:
    import json
    import os

    text = json.dumps({"name": name, "m": kernel.m, "eps": kernel.eps, "pid": os.getpid()})
    with open(path, "w") as f:
        if _named_by(FAKE_TORN_ENV, name):
            f.write(text[:len(text) // 2])
            f.flush()
            raise OSError("simulated failure half way through writing the kernel")
        f.write(text)


def fake_load(path: str, name: str) -> FakeKernel:
    import json

    with open(path) as f:
        d = json.load(f)
    assert d["name"] == name, (d, name)
    return FakeKernel(name, d["m"], d["eps"])


def fake_directory():
    import os

    root = os.environ.get("K3_CUTE_CACHE_DIR", "0")
    return None if root == "0" else os.path.join(root, "fake")


def fake_warm_up() -> None:
    """Leaves a file named by this process's id in ``K3_CUTE_CACHE_DIR``/warm: which workers ran it."""
    import os

    folder = os.path.join(os.environ["K3_CUTE_CACHE_DIR"], "warm")
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, str(os.getpid())), "w").close()


def fake_cute_builder(warm_up: bool = False):
    """The ``kernel_cache.Builder`` to register as the "cute" kind (``warm_up``: with :func:`fake_warm_up`)."""
    from k3compile import kernel_cache
    from k3compile.kernels.cute.compile import variant_name

    return kernel_cache.Builder(fake_compile, fake_export, fake_load, variant_name, fake_directory, suffix=".json",
                                warm_up=fake_warm_up if warm_up else None)
