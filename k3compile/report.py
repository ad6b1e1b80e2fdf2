"""``k3compile.report(model)``: what our passes did to a compiled model, and which kernels ran for it."""
from __future__ import annotations

from dataclasses import dataclass, field

from .choices import Choice
from .graph_records import CompiledGraph
from .optimize import nothing_done, state_of, warn_if_nothing_done
from .passes import STATIC_WEIGHT_FACT


@dataclass
class Report:
    passes: tuple                                  # enabled pass names, in order
    matches: dict                                  # pass -> total matches over all graphs
    graphs: list[CompiledGraph]
    choices: list[Choice]                          # op implementation records (this model's calls)
    pass_seconds: float                            # time our passes added to compilation
    registration_seconds: float                    # of which: pattern registration
    compile_seconds: float                         # wall time of all compile_fx calls
    backend: str
    unknown_graphs: int = 0                        # cache hits without a stored record
    op_calls: dict = field(default_factory=dict)   # op -> calls seen by dispatch (what ran)
    # op -> {"proven": n, "not proven": {reason: n}} over all graphs (static_weights.py)
    static_weight: dict = field(default_factory=dict)
    model_name: str = "model"
    notice: str = ""                               # where the model compiled or rewrote nothing: why
    regions: str = ""                              # which blocks optimize() made compile regions, or why none
    inductor_pdl: str = ""                         # whether Inductor's own kernels launch with PDL (optimize.py)

    @property
    def kernel_build_seconds(self) -> float:
        """Host time of the k3 ops' first calls for this model (their kernels' JIT builds or disk-cache loads)."""
        return sum(c.first_call_seconds or 0.0 for c in self.choices)

    @property
    def precompiled(self) -> list:
        """The build-ahead records (``precompile.PrecompileRecord``) of the graphs whose kernels were built ahead."""
        return [g.precompile for g in self.graphs if g.precompile is not None and g.precompile.on]

    @property
    def kernels_compiled(self) -> int:
        """Kernels built ahead of their first call, by worker processes, while the graphs compiled."""
        return sum(r.compiled for r in self.precompiled)

    @property
    def kernel_cache_hits(self) -> int:
        """Kernels the graphs call that were already built (in this process or in the disk cache)."""
        return sum(r.cached for r in self.precompiled)

    @property
    def kernel_compile_seconds(self) -> float:
        """The builds' own time, summed over the worker processes (they ran beside Inductor's compile)."""
        return sum(r.build_seconds for r in self.precompiled)

    @property
    def kernel_failures(self) -> dict:
        """Kernel name (its key) -> "k3::op (implementation): error", for each build that failed ahead."""
        return {name: why for r in self.precompiled for name, why in r.failed.items()}

    @property
    def cache_hits(self) -> int:
        return sum(1 for g in self.graphs if g.source.startswith("cache hit"))

    def __str__(self) -> str:
        return self.format()

    def format(self, verbose: bool = False) -> str:
        """The table; ``verbose`` lists each shape's kernel choice instead of grouping equal choices, and the
        static-weight verdicts of CPU graphs too (a launch detail of GPU kernels, so shown for GPU graphs only)."""
        lines = [f"k3compile report for {self.model_name}: {len(self.graphs)} graph(s) compiled, "
                 f"{self.cache_hits} served from the cache, backend={self.backend!r}"]
        if self.notice:
            lines.append("  " + self.notice.removeprefix("k3compile: "))
        stood_down = [g for g in self.graphs if g.stood_down]
        for why in dict.fromkeys(g.stood_down for g in stood_down):
            lines.append(f"  {why}")
        if len(stood_down) < len(self.graphs):
            lines.append(f"  passes added {self.pass_seconds:.3f} s to {self.compile_seconds:.3f} s of "
                         f"compilation (registration {self.registration_seconds:.3f} s)")
        if self.regions:
            lines.append(f"  compile regions: {self.regions}")
        for i, g in enumerate(self.graphs):
            what = g.source if g.source != "pass ran" else "passes ran"
            lines.append(f"  graph {i}{f' ({g.label})' if g.label else ''}: {what}, compile {g.compile_seconds:.3f} s"
                         + (f", passes {g.record.seconds:.3f} s" if g.record and g.source == "pass ran" else "")
                         + (f"; {g.regions}" if g.regions else ""))
        if len(stood_down) < len(self.graphs) or not self.graphs:
            lines.append("  pass matches:")
            for name in self.passes:
                per_graph = [str(g.record.matches.get(name, 0)) if g.record else "?" for g in self.graphs]
                lines.append(f"    {name:<20} {self.matches.get(name, 0):>5}   per graph: {', '.join(per_graph)}")
        if self.unknown_graphs:
            lines.append(f"  ({self.unknown_graphs} cached graph(s) had no stored record: counts incomplete)")
        gpu_details = verbose or any(g.on_gpu for g in self.graphs)   # launch details, shown for GPU graphs
        if gpu_details and self.inductor_pdl:
            lines.append(f"  Inductor's own kernels with PDL (inductor_pdl): {self.inductor_pdl}")
        show_static = self.static_weight and gpu_details
        if show_static:
            lines.append("  static weight (weight streamed before the PDL wait), per op node:")
        for op, r in (self.static_weight if show_static else {}).items():
            why_not = r["not proven"]
            total = r["proven"] + sum(why_not.values())
            line = f"    {op:<20} proven {r['proven']} of {total}"
            if why_not:
                line += "; not proven: " + "; ".join(f"{why} (x{n})" for why, n in why_not.items())
            lines.append(line)
        lines += self._precompile_lines()
        built = [c.first_call_seconds for c in self.choices if c.first_call_seconds is not None]
        if built:
            lines.append(f"  k3 kernels: the first calls of {len(built)} key(s) in this process took "
                         f"{sum(built):.1f} s of host time (Triton / CuTe JIT builds, or loads from their disk caches)")
        lines.append("  kernels chosen:")
        if not self.choices:
            lines.append("    (no k3 op has run for this model)")
        if verbose:
            for c in self.choices:
                lines.append(f"    {c.op:<16} asked {c.backend!r:<12} ran {c.impl:<10} x{c.calls:<6} "
                             f"{_key_str(c.key)}: {c.reason}")
            return "\n".join(lines)
        groups: dict = {}
        for c in self.choices:  # one line per (op, asked, ran, reason): shapes and calls summed
            g = groups.setdefault((c.op, c.backend, c.impl, c.reason), [0, 0])
            g[0] += 1
            g[1] += c.calls
        for (op, asked, impl, reason), (shapes, calls) in groups.items():
            lines.append(f"    {op:<16} asked {asked!r:<8} ran {impl:<10} {shapes:>3} shape(s) {calls:>6} call(s): "
                         f"{reason}")
        return "\n".join(lines)


    def _precompile_lines(self) -> list[str]:
        records = self.precompiled
        if not records:
            off = {g.precompile.why for g in self.graphs if g.precompile is not None and g.on_gpu}
            return [f"  k3 kernels built ahead of the first call: {why}" for why in sorted(off)]
        calls, symbolic = sum(r.calls for r in records), sum(r.symbolic for r in records)
        wall, waited = sum(r.wall_seconds for r in records), sum(r.waited_seconds for r in records)
        workers = max(r.workers for r in records)
        built = (f"{self.kernels_compiled} compiled in {workers} worker process(es) "
                 f"({self.kernel_compile_seconds:.1f} s of build time, {wall:.1f} s wall, {waited:.1f} s of it after "
                 "Inductor finished)" if workers else "none compiled")
        lines = [f"  k3 kernels built ahead of the first call: {built}, {self.kernel_cache_hits} already built (this "
                 f"process or the disk cache), {len(self.kernel_failures)} failed; for {calls} call(s)"
                 + (f", {symbolic} of them at planned values of a symbolic size (M buckets and the example's)"
                    if symbolic else "")]
        lines += [f"    failed: {name}: {why}" for name, why in self.kernel_failures.items()]
        unplanned: dict = {}
        for r in records:
            for why, n in r.unplanned.items():
                unplanned[why] = unplanned.get(why, 0) + n
        lines += [f"    not built ahead (built at the first call): {why} (x{n})" for why, n in unplanned.items()]
        return lines


def _key_str(key) -> str:
    # The skinny-GEMM key is (dtype, device, (M, K), N, then the operands' layouts and the output dtype: see
    # ops/skinny_gemm/dispatch.py ``key``); other ops use readable strings.
    if isinstance(key, tuple) and len(key) >= 4 and isinstance(key[2], (tuple, list)):
        head = f"{str(key[0]).replace('torch.', '')} {key[1]} [M,K]={list(key[2])} N={key[3]}"
        rest = [f"{n} strides {tuple(layout[0])}" + ("" if layout[1] else " unaligned")
                for n, layout in zip(("a", "w", "bias", "residual"), key[4:8]) if layout is not None]
        if len(key) > 8 and key[8] is not None:
            rest.append(f"out {str(key[8]).replace('torch.', '')}")
        return ", ".join([head, *rest])
    return str(key)


def report(model) -> Report:
    """For this model: each graph compiled (labelled prefill / decode) and what the passes rewrote in it, the
    implementation each k3 op ran for this model's calls and why, and the time our passes added to
    compilation. Truthful on a warm start: graphs served by the FX cache report the counts stored when they
    were compiled. Where the model compiled or rewrote nothing, the report says so and a warning is logged."""
    state = state_of(model)
    warn_if_nothing_done(state)
    with state.lock:
        graphs = list(state.graphs)
    matches: dict = {name: 0 for name in state.options.enabled}
    pass_s = reg_s = 0.0
    for g in graphs:
        if g.record is None:
            continue
        for name, n in g.record.matches.items():
            matches[name] = matches.get(name, 0) + n
        if g.source == "pass ran":  # a cache hit added no pass time now
            pass_s += g.record.seconds
            reg_s += g.record.registration_seconds
    static: dict = {}
    for g in graphs:
        for op, r in ((g.record.facts.get(STATIC_WEIGHT_FACT) or {}) if g.record else {}).items():
            total = static.setdefault(op, {"proven": 0, "not proven": {}})
            total["proven"] += r.get("proven", 0)
            for why, n in r.get("not proven", {}).items():
                total["not proven"][why] = total["not proven"].get(why, 0) + n
    with state.lock:
        choices = list(state.choices.values())
    op_calls: dict = {}
    for c in choices:
        op_calls[c.op] = op_calls.get(c.op, 0) + c.calls
    return Report(
        passes=state.options.enabled, matches=matches, graphs=graphs, choices=choices,
        pass_seconds=pass_s, registration_seconds=reg_s,
        compile_seconds=sum(g.compile_seconds for g in graphs), backend=state.options.backend,
        unknown_graphs=sum(1 for g in graphs if g.record is None), op_calls=op_calls, static_weight=static,
        model_name=state.model_name, notice=nothing_done(state) or "", regions=state.regions,
        inductor_pdl=state.inductor_pdl,
    )
