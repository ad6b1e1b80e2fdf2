"""Shared test set-up: hypothesis profiles, the GPU marker, deterministic seeds, Inductor's caches off
(``no_graph_caches``), and the pass harness pattern tests compile through (``pass_harness``)."""
import collections
import os

import torch

# Triton kernels run on CPU tensors through the interpreter when no GPU is present; CuTe DSL (where installed)
# compiles for sm_90a, the H200's arch, not its own default. Set before anything imports triton or cutlass.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    # Inductor's C++ kernels built without -O3 and without SIMD code: the suite compiles ~100 graphs on a cold CPU
    # machine and tests what they compute, not how fast (a cold run of tests/compiler/test_tiny_k3.py: 171 s with
    # -O3, 120 s without; the micro K3's prefill and decode graphs: 71 s with SIMD kernels, 54 s without, g++ ran
    # 46 s and 32 s of it)
    os.environ.setdefault("TORCHINDUCTOR_DEBUG_COMPILE", "1")
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
    # One thread a process: the README's run has a worker per core, and the tensors are small. Intra-op threads and
    # Inductor's pool of compile processes only contend for the cores there (a cold run: 232 s of
    # tests/compiler/test_tiny_k3.py with the pool, 192 s without). The environment reaches the tests' subprocesses.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import pytest  # noqa: E402


def _patch_language_once_a_launch():
    """Triton's interpreter (3.6-3.7) patches ``triton.language`` for the interpreter at each launch and again at
    every call of a nested ``@triton.jit`` function inside it (``InterpretedFunction.__call__``), walking every
    member of the language modules each time: 385 nested calls in one KDA decode launch, ~28% of its time. Within a
    launch the modules are already patched (the launch restores them at its end), so a nested call whose modules
    the launch patched skips it. Test speed only; where the interpreter differs from this shape nothing changes."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import inspect
        import threading

        import triton.language as tl
        from triton.runtime import interpreter
    except Exception:
        return
    if not all(hasattr(interpreter, n) for n in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return
    state, patch_lang, launch = threading.local(), interpreter._patch_lang, interpreter.GridExecutor.__call__

    def langs_of(fn):
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_once(fn):
        done, langs = getattr(state, "langs", None), langs_of(fn)
        if done is not None and langs <= done:
            return interpreter._LangPatchScope()   # nothing to restore
        scope = patch_lang(fn)
        if done is not None:
            state.langs = done | langs
        return scope

    def launch_once(self, *args, **kwargs):
        outer = getattr(state, "langs", None)
        state.langs = set() if outer is None else outer   # the launch's own patch fills it
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.langs = outer

    interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_once, launch_once


_patch_language_once_a_launch()

from hypothesis import HealthCheck, Phase, settings  # noqa: E402

# On a GPU a failing draw is reported as drawn, not shrunk: a draw there may build kernels for seconds each, and
# shrinking builds more until a device call's time limit ends the run with nothing printed
# (K3_HYPOTHESIS_SHRINK=1 shrinks anyway)
_PHASES = ({"phases": (Phase.explicit, Phase.reuse, Phase.generate)}
           if torch.cuda.is_available() and os.environ.get("K3_HYPOTHESIS_SHRINK") != "1" else {})
# K3_HYPOTHESIS_PROFILE=deep draws many more cases for long local runs; CI uses "ci".
settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture], **_PHASES,
)
settings.register_profile(
    "deep", max_examples=500, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture], **_PHASES,
)
settings.load_profile(os.environ.get("K3_HYPOTHESIS_PROFILE", "ci"))


DEEP = os.environ.get("K3_HYPOTHESIS_PROFILE") == "deep"


def pytest_configure(config):
    # pytest-xdist hands the files (--dist loadfile) to its workers in collection order, but first sorts them by
    # their number of tests, which starts a file of one long test last and leaves the other worker idle while it
    # runs; the order pytest_collection_modifyitems gives (long files first) is kept instead.
    if getattr(config.option, "loadscopereorder", False):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    skip_deep = pytest.mark.skip(reason="a long run another test covers in part; K3_HYPOTHESIS_PROFILE=deep runs it")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    long_files = set()
    for item in items:
        skipped = False
        if "deep" in item.keywords and not DEEP:
            item.add_marker(skip_deep)
            skipped = True
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
            skipped = True
        if "slow" in item.keywords and not skipped:
            long_files.add(item.path)
    # files with a slow test that runs first, each file's tests in their order: the workers share the long ones and
    # end on the short ones
    items.sort(key=lambda item: item.path not in long_files)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def gloo_world_of_one():
    """A one-rank gloo process group in this process (a hash store, no port); yields its group name.
    Enough to run (and compile) collectives; skips where a group already exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


@pytest.fixture
def no_graph_caches():
    """Inductor's FX-graph and AOTAutograd caches off: a cache hit would skip our pass (the C++ kernel cache stays
    on: it only saves g++ time)."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def op_counts(graph) -> collections.Counter:
    """How many times each op is called in ``graph`` (a mutating op wrapped in ``auto_functionalized`` counts as
    itself)."""
    counts = collections.Counter()
    for node in graph.nodes:
        if node.op == "call_function":
            wrapped = node.args[0] if "auto_functionalized" in str(node.target) and node.args else None
            counts[wrapped if wrapped is not None else node.target] += 1
    return counts


class PassHarness:
    """Our post-grad pass as a test sees it: every graph it rewrites is kept as it was before and after (op counts
    and code), with the pass's record (matches per pass, facts). Install it with ``compile`` (Inductor) or apply it
    to a traced graph with ``rewrite``; then ask which k3 ops replaced which ATen ops. Caches must be off
    (``no_graph_caches``): a cache hit runs no pass."""

    def __init__(self, **options):
        from k3compile.passes import COMPILE_RECORD, K3Options, K3PostGradPass

        harness = self
        self.graphs: list[dict] = []   # {"before": Counter, "after": Counter, "code": str, "record": GraphRecord}

        class Recording(K3PostGradPass):
            def __call__(self, graph):
                before = op_counts(graph)
                super().__call__(graph)
                harness.graphs.append(dict(before=before, after=op_counts(graph), code=str(graph),
                                           record=COMPILE_RECORD.graphs[-1]))

        self.pass_ = Recording(K3Options(**options))

    def compile(self, fn, **torch_compile_kwargs):
        """``torch.compile(fn)`` with Inductor and this pass installed (Dynamo reset first)."""
        torch._dynamo.reset()
        options = dict(torch_compile_kwargs.pop("options", {}), post_grad_custom_post_pass=self.pass_)
        return torch.compile(fn, options=options, **torch_compile_kwargs)

    def rewrite(self, fn, *args):
        """``fn`` traced to a post-grad-like ATen graph on fake tensors (Inductor's decompositions, views as
        reshapes), this pass applied; the rewritten module (callable on real tensors)."""
        from torch._guards import detect_fake_mode
        from torch._inductor.decomposition import select_decomp_table
        from torch._inductor.fx_passes.post_grad import view_to_reshape
        from torch._inductor.virtualized import V
        from torch.fx.experimental.proxy_tensor import make_fx

        gm = make_fx(lambda *a: fn(*a), select_decomp_table(), tracing_mode="fake")(*args)
        view_to_reshape(gm)
        gm.graph.eliminate_dead_code()
        fake_mode = detect_fake_mode([n.meta["val"] for n in gm.graph.nodes if "val" in n.meta])
        with V.set_fake_mode(fake_mode):
            self.pass_(gm.graph)
        gm.recompile()
        return gm

    def before(self, op) -> int:
        return sum(g["before"][op] for g in self.graphs)

    def after(self, op) -> int:
        return sum(g["after"][op] for g in self.graphs)

    def matches(self, name: str) -> int:
        return sum(g["record"].matches.get(name, 0) for g in self.graphs)

    def facts(self, key: str) -> list:
        return [g["record"].facts.get(key) for g in self.graphs]

    def check(self, replaced=(), added=None, kept=()):
        """Each op of ``replaced`` was in the graphs before and is gone after, each of ``added`` (op -> count) is
        there that many times after and was not before, each of ``kept`` is as often after as before."""
        code = "\n\n".join(g["code"] for g in self.graphs)
        for op in replaced:
            assert self.before(op) > 0 and self.after(op) == 0, f"{op}: {self.before(op)} -> {self.after(op)}\n{code}"
        for op, n in (added or {}).items():
            assert self.before(op) == 0 and self.after(op) == n, f"{op}: {self.before(op)} -> {self.after(op)}\n{code}"
        for op in kept:
            assert self.after(op) == self.before(op), f"{op}: {self.before(op)} -> {self.after(op)}\n{code}"


@pytest.fixture
def pass_harness(no_graph_caches):
    """``pass_harness(**K3Options fields)``: a PassHarness (caches off for the test)."""
    return PassHarness
