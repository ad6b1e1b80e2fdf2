"""Where a decode step's time goes: the kernels of a ``torch.profiler`` run sorted into the model's parts.

Categories (``CATEGORIES``): the routed experts, the router, dense GEMMs (every other weight product: attention and
MLP projections, latent down/up projections, shared experts, lm_head), KDA and MLA (their cores: convolutions,
gates, the delta rule, attention over the cache), AttnRes and norms, collectives, glue (whatever else: casts,
embedding, activations) and gaps (the step's time that no kernel fills; ``breakdown`` takes it from the CUDA-graph
time of the step).

A kernel's category comes from what launched it, in this order:

1. its own name: NCCL kernels are collectives;
2. the profiler event that launched it and that event's parents, innermost first:
   - an Inductor kernel (its launch event carries the kernel's name): the model source lines of the FX nodes Inductor
     generated it from, recorded while Inductor wrote the kernel (``KernelOrigins``);
   - a ``k3::`` op: by the op (``K3_OPS``); the skinny GEMM by its weight's shape;
   - an event with a Python stack in the model (eager, ``with_stack=True``): by the model frames (``category_of``);
3. a GEMM with no model frame (cuBLAS under a compiled graph): by the shapes it multiplies, looked up among the
   model's weights and caches (``ShapeTable``); an unknown GEMM is a dense GEMM;
4. anything else is glue.
"""
from __future__ import annotations

import os
import re
from collections import Counter, defaultdict
from contextlib import contextmanager
from typing import Iterable, Optional

import torch

CATEGORIES = ("experts", "router", "dense GEMMs", "KDA", "MLA", "AttnRes and norms", "collectives", "glue", "gaps")

COLLECTIVE = re.compile(r"nccl|c10d|all_?reduce|all_?gather|reduce_?scatter|broadcast", re.I)
GEMM_OP = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|addmv|mv)$")
GEMM_KERNEL = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|splitKreduce|wgmma", re.I)
INDUCTOR_KERNEL = ("triton_", "cpp_", "graph_")
COPIES = ("Memcpy", "Memset")   # the profiler's names of device copies and fills
FX_GEMM = re.compile(r"^aten\.(mm|addmm|bmm|baddbmm|_scaled_mm)\b")
K3_OPS = {"kda_decode": "KDA", "kda_prefill": "KDA", "mla_decode": "MLA", "moe_experts": "experts",
          "moe_route": "router", "attn_res": "AttnRes and norms", "attn_res_add": "AttnRes and norms",
          "all_reduce_": "collectives", "latent_moe_tail": "dense GEMMs",
          "experts_beside": "glue",   # its own kernel is the shared experts' SiTU-GLU; its nested ops are theirs
          "skinny_gemm": None}   # None: by shape

# model source (file, function) -> category; file-wide rules after the function rules
EXPERT_FUNCTIONS = {"_gathered", "experts_gathered", "experts_gathered_mxfp4", "_dense_outputs", "_dense_combine",
                    "experts_dense", "experts_dense_mxfp4"}
FRAME = re.compile(r'File "([^"]+)", line \d+, in (\S+)')       # an FX node's stack_trace (outermost first)
PROFILER_FRAME = re.compile(r"^(.*)\((\d+)\): (\S+)$")           # a profiler stack entry (innermost first)


def model_files() -> tuple[str, set]:
    """The model package's folder name and its source files (profiler stacks shorten paths to ``model/kda.py``)."""
    import k3compile.model

    where = os.path.dirname(os.path.abspath(k3compile.model.__file__))
    return os.path.basename(where), {f for f in os.listdir(where) if f.endswith(".py")}


def category_of(frames: Iterable[tuple[str, str]], gemm: bool) -> Optional[str]:
    """Category from the model frames of a call stack ((file, function) pairs, any order), or None without one.
    ``gemm``: the op is a weight product (a product in no rule of its own is a dense GEMM)."""
    folder, files = model_files()
    found = [(os.path.basename(f), fn) for f, fn in frames
             if os.path.basename(f) in files and os.path.basename(os.path.dirname(f)) == folder]
    if not found:
        return None
    files = {f for f, _ in found}
    if any((f == "moe.py" and fn in EXPERT_FUNCTIONS) or f == "mxfp4.py" for f, fn in found):
        return "experts"
    if ("moe.py", "route") in found:
        return "router"
    if "parallel.py" in files:
        return "collectives"
    if any(f == "mla.py" and fn in ("mla_attend", "write_latent") for f, fn in found):
        return "MLA"
    if gemm:
        return "dense GEMMs"
    if "attn_res.py" in files or ("layers.py", "rms_norm") in found:
        return "AttnRes and norms"
    if "kda.py" in files:
        return "KDA"
    if "mla.py" in files:
        return "MLA"
    return "glue"


def fx_node_category(node: torch.fx.Node) -> Optional[str]:
    """Category of a post-grad FX node from its ``stack_trace`` (None without model frames)."""
    trace = node.meta.get("stack_trace") or ""
    return category_of(FRAME.findall(trace), bool(FX_GEMM.match(str(node.target))))


class KernelOrigins:
    """kernel name -> category, recorded while Inductor defines each kernel (Triton on GPUs, C++ on the CPU) from
    the FX nodes it fuses: the category most of them have (a GEMM among them decides for the whole kernel).

    Inductor names kernels per compiled graph, so ``clear()`` before compiling the graph whose profile is read.
    Nothing is recorded for a graph served from the FX cache (its code is not generated again)."""

    def __init__(self):
        self.categories: dict[str, str] = {}

    def clear(self) -> None:
        self.categories.clear()

    def record(self, name: str, nodes) -> None:
        origins = []
        for node in nodes if isinstance(nodes, (list, tuple)) else [nodes]:
            for part in node.get_nodes() if hasattr(node, "get_nodes") else [node]:
                origins += list(getattr(getattr(part, "node", None), "origins", None) or ())
        votes = Counter()
        for origin in origins:
            if getattr(origin, "op", None) == "call_function":
                cat = fx_node_category(origin)
                if cat is not None:
                    votes[cat] += 100 if cat != "glue" and FX_GEMM.match(str(origin.target)) else 1
        if votes:
            self.categories[str(name)] = max(votes, key=lambda c: (votes[c], -CATEGORIES.index(c)))

    @contextmanager
    def recording(self):
        """Wrap Inductor's ``define_kernel`` of the Triton and C++ schedulings while compiling."""
        patched = []
        for module, cls in (("torch._inductor.codegen.triton", "TritonScheduling"),
                            ("torch._inductor.codegen.cpp", "CppScheduling")):
            try:
                owner = getattr(__import__(module, fromlist=[cls]), cls)
                original = owner.__dict__["define_kernel"]
            except (ImportError, AttributeError, KeyError):
                continue

            def define_kernel(self_, src_code, nodes, *args, _original=original, **kwargs):
                name = _original(self_, src_code, nodes, *args, **kwargs)
                try:
                    self.record(name, nodes)
                except Exception:   # attribution is best effort; never break a compile over it
                    pass
                return name

            owner.define_kernel = define_kernel
            patched.append((owner, original))
        try:
            yield self
        finally:
            for owner, original in patched:
                owner.define_kernel = original


class ShapeTable:
    """The last two dimensions of the model's weights and cache tensors -> category, both orientations (a GEMM
    multiplies a weight or its transpose). Priority where shapes coincide: experts, router, MLA, dense GEMMs."""

    ORDER = ("experts", "router", "MLA", "dense GEMMs")

    def __init__(self, model, cache=None):
        self.table: dict[tuple, str] = {}
        for name, p in model.language_model.named_parameters():
            if p.dim() < 2:
                continue
            rows, cols = p.shape[-2:]
            if ".experts." in name:
                cat = "experts"
                if p.dtype == torch.uint8:          # MXFP4 codes [.., R, C/2]: the products use [.., R, C]
                    cols = cols * 2 if name.endswith("_packed") else cols * 32
            elif name.endswith("gate.weight") and ".block_sparse_moe." in name:
                cat = "router"
            elif name.endswith("kv_b_proj.weight"):     # absorbed per head: [H, N + Vd, Lk] and its halves
                attn = model.text_model.layers[int(re.search(r"layers\.(\d+)\.", name).group(1))].self_attn
                for r in (attn.nope + attn.v_dim, attn.nope, attn.v_dim):
                    self.add((r, cols), "MLA")
                cat = "dense GEMMs"
            else:
                cat = "dense GEMMs"
            self.add((rows, cols), cat)
        for state in (cache.layers if cache is not None else []):
            if hasattr(state, "c_kv"):
                for t in state.tensors():
                    self.add(tuple(t.shape[-2:]), "MLA")

    def add(self, dims: tuple, cat: str) -> None:
        for key in (tuple(dims), tuple(dims)[::-1]):
            old = self.table.get(key)
            if old is None or self.ORDER.index(cat) < self.ORDER.index(old):
                self.table[key] = cat

    def gemm(self, shapes) -> str:
        found = [self.table.get(tuple(s[-2:])) for s in shapes or () if isinstance(s, (list, tuple)) and len(s) >= 2]
        found = [c for c in found if c is not None]
        return min(found, key=self.ORDER.index) if found else "dense GEMMs"


def _chain(event):
    while event is not None:
        yield event
        event = event.cpu_parent


def categorize(kernel: str, launcher, origins: KernelOrigins, shapes: ShapeTable) -> str:
    """The category of device kernel ``kernel`` launched under profiler event ``launcher`` (see the module doc)."""
    if "nccl" in kernel.lower():
        return "collectives"
    gemm = bool(GEMM_KERNEL.search(kernel))
    frames = []
    for event in _chain(launcher):
        name = _kernel_name(event.name)
        if name in origins.categories:
            return origins.categories[name]
        if name.startswith("k3::"):
            cat = K3_OPS.get(name[4:].split(".")[0], "")
            if cat is None:
                return shapes.gemm(event.input_shapes)
            if cat:
                return cat
        if COLLECTIVE.search(name) and not name.startswith(INDUCTOR_KERNEL):
            return "collectives"
        gemm = gemm or bool(GEMM_OP.match(name))
        # eager under with_stack=True: the Python frames are events of their own (``model/kda.py(52): fn``)
        for entry in [name] + list(getattr(event, "stack", None) or []):
            m = PROFILER_FRAME.match(entry)
            if m:
                frames.append(m.group(1, 3))
    cat = category_of(frames, gemm)
    if cat is not None:
        return cat
    if gemm:
        return shapes.gemm(next((e.input_shapes for e in _chain(launcher) if GEMM_OP.match(e.name)), None))
    return "glue"


def _kernel_name(name: str) -> str:
    """Inductor's C++ kernels profile as ``graph_<n>_<kernel name>``."""
    return re.sub(r"^graph_\d+_(?=cpp_)", "", name)


def device_kernels(events, on_device: bool):
    """(kernel name, µs, launching event) of every kernel of a profile. On a device a kernel's µs are those it alone
    occupied the device (``device_timeline``), where the profile's device events link to their op events; else its
    whole duration. Without a device (the CPU), the leaf op and Inductor kernel events stand in for kernels (their
    self time; the dry run's figures mean nothing)."""
    if on_device:
        timeline = device_timeline(events)
        if timeline is not None:
            return timeline
    out = []
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        if on_device:
            out += [(k.name, k.duration, event) for k in event.kernels]
        elif not event.cpu_children and ("::" in event.name or event.name.startswith(INDUCTOR_KERNEL)):
            out.append((event.name, event.self_cpu_time_total, event))
    return out


def _device_events(events) -> list:
    """The profile's device events (kernels, copies, fills) in the order they start."""
    cpu = torch.autograd.DeviceType.CPU
    return sorted((e for e in events if e.device_type != cpu), key=lambda e: (e.time_range.start, e.time_range.end))


def _exclusive_us(device) -> list:
    """Each device event's µs counted from when the events before it had all ended (see ``device_timeline``)."""
    out, busy_until = [], float("-inf")
    for event in device:
        start, end = event.time_range.start, event.time_range.end
        out.append(max(0.0, end - max(start, busy_until)))
        busy_until = max(busy_until, end)
    return out


def device_timeline(events) -> Optional[list]:
    """(kernel name, µs, launching op event) of the profile's device events in the order they start, each kernel's
    µs counted from when the kernels before it had all ended: a kernel launched early (PDL) that waits on its
    predecessor, or one overlapping another stream's, is charged only the time no earlier kernel covered, so the
    kernels' sum is the time the device was busy, not more (summed whole, an H200 decode step's kernels came to more
    than the step). None where no device event links to an op event (``linked_correlation_id``)."""
    cpu = torch.autograd.DeviceType.CPU
    ops = {e.id: e for e in events if e.device_type == cpu and not getattr(e, "linked_correlation_id", 0)}
    device = _device_events(events)
    launchers = [ops.get(getattr(e, "linked_correlation_id", 0)) for e in device]
    if not any(launcher is not None for launcher in launchers):
        return None
    return [(e.name, us, launcher) for e, us, launcher in zip(device, _exclusive_us(device), launchers)]


def graphed_timeline(launched, graph_events, replays: int) -> Optional[list]:
    """``device_timeline``'s list for steps launched one by one (``launched``), timed instead by a profile of
    ``replays`` replays of the same steps captured in one CUDA graph (``graph_events``): the graph runs the same
    kernels in the same order, without the host's launch gaps, so each keeps its name and launcher from
    ``launched`` and takes its exclusive µs from the replays (their mean). None where the replays' device events
    are not ``replays`` copies of ``launched``'s sequence (a kernel the graph lacks or adds; then the un-graphed
    figures stand)."""
    device = _device_events(graph_events)
    for keep in (lambda name: True, lambda name: not name.startswith(COPIES)):   # copies may not trace in graphs
        steps = [k for k in launched if keep(k[0])]
        replayed = [e for e in device if keep(e.name)]
        if len(replayed) == replays * len(steps) and all(
                e.name == steps[i % len(steps)][0] for i, e in enumerate(replayed)):
            break
    else:
        return None
    us = [0.0] * len(steps)
    for i, t in enumerate(_exclusive_us(replayed)):
        us[i % len(steps)] += t / replays
    return [(name, t, launcher) for (name, _, launcher), t in zip(steps, us)]


DTYPE_BYTES = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4}


def skinny_gemm_weight(launcher) -> Optional[tuple[int, int, int]]:
    """(N, K, bytes an element) of the weight of the ``k3::skinny_gemm`` call that launched a kernel, or None."""
    for event in _chain(launcher):
        if event.name.startswith("k3::skinny_gemm"):
            shapes = event.input_shapes or ()
            if len(shapes) > 1 and len(shapes[1]) == 2:
                dtypes = getattr(event, "input_dtypes", None) or ()
                return (*shapes[1], DTYPE_BYTES.get(dtypes[1] if len(dtypes) > 1 else "", 2))
            return None
    return None


def breakdown(kernels, steps: int, step_us: float, origins: KernelOrigins, shapes: ShapeTable) -> dict:
    """Per step: µs by category (``gaps`` = ``step_us`` minus the kernels' sum, at least 0), the kernel count, the
    kernels that take most time (name, category, µs a step, launches a step), and the skinny GEMM's kernels by weight
    shape (µs and launches a step, TB/s of the weight bytes over those µs: which products of the step stream slowly),
    and the first step's kernels in order (what each boundary between kernels costs)."""
    by_cat = defaultdict(float)
    per_kernel = defaultdict(lambda: [0.0, 0])               # (name, category) -> [µs, launches]
    per_weight = defaultdict(lambda: [0.0, 0])               # (category, N, K, bytes an element) -> [µs, launches]
    sequence = []                                            # the first step's kernels in order
    for i, (name, us, launcher) in enumerate(kernels):
        cat = categorize(name, launcher, origins, shapes)
        weight = skinny_gemm_weight(launcher)
        if i < len(kernels) // max(steps, 1):
            sequence.append(dict(kernel=name[:80], category=cat, us=round(us, 3),
                                 **({"weight": f"{weight[0]}x{weight[1]}"} if weight else {})))
        by_cat[cat] += us / steps
        entry = per_kernel[name, cat]
        entry[0] += us / steps
        entry[1] += 1
        if weight is not None:
            entry = per_weight[(cat, *weight)]
            entry[0] += us / steps
            entry[1] += 1
    busy = sum(by_cat.values())
    by_cat["gaps"] = max(0.0, step_us - busy)
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:20]
    gemms = sorted(per_weight.items(), key=lambda kv: -kv[1][0])
    return dict(us={c: round(by_cat.get(c, 0.0), 3) for c in CATEGORIES}, kernel_us=round(busy, 3),
                kernels_per_step=len(kernels) / steps,
                top=[dict(kernel=k[:120], category=c, us=round(us, 3), launches=n / steps)
                     for (k, c), (us, n) in top],
                skinny_gemms=[dict(weight=f"{n}x{k}", category=c, us=round(us, 3), launches=count / steps,
                                   tbps=round(count / steps * n * k * size / us / 1e6, 3) if us > 0 else None)
                              for (c, n, k, size), (us, count) in gemms],
                sequence=sequence)
