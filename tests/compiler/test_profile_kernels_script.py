"""benchmarks/profile_kernels.py: reading ncu's raw CSV page (the GPU run itself needs ncu and a GPU)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("profile_kernels", ROOT / "benchmarks" / "profile_kernels.py")
profile_kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile_kernels)

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
HEADER = ["ID", "Kernel Name", "gpu__time_duration.sum", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
          "sm__inst_issued.avg.per_cycle_active", "sm__cycles_active.avg", "launch__registers_per_thread",
          STALL.format("long_scoreboard"), STALL.format("wait"), STALL.format("imc_miss"),
          STALL.format("selected"), STALL.format("barrier")]


def _csv(*rows) -> str:
    return "\n".join(",".join(f'"{c}"' for c in row) for row in rows)


def test_parse_raw_reads_units_metrics_and_the_top_stalls():
    raw = _csv(HEADER, ["", "", "ns", "%", "inst/cycle", "cycle", "register/thread"] + ["ratio"] * 5,
               ["0", "_gate_up_kernel(int, int)", "46,700", "10.6", "1.41", "57,500", "232",
                "0.38", "0.84", "0", "1.00", "0.05"],
               ["1", "_down_kernel", "26700", "n/a", "1.3", "30600", "170", "1.3", "0.89", "0.2", "1.0", "0.1"])
    gate_up, down = profile_kernels.parse_raw(raw)
    assert gate_up["kernel"] == "_gate_up_kernel" and gate_up["µs"] == 46.7 and gate_up["dram %"] == 10.6
    assert gate_up["regs"] == 232 and abs(gate_up["k instr/SM"] - 1.41 * 57.5) < 1e-9
    assert list(gate_up["stalls"]) == ["selected", "wait", "long_scoreboard", "barrier"]   # the top 4, none zero
    assert down["dram %"] is None and down["grid"] is None and list(down["stalls"])[0] == "long_scoreboard"
