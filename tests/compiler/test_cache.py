"""Two processes, one Inductor cache directory: the second hits the FX graph cache with our pass
installed (so no pass runs) and its report still shows the matches; another option misses."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("_cache_child.py")


def run_child(cache_dir: Path, limit: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHINDUCTOR_", "TRITON_CACHE", "TORCH_COMPILE"))}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    # conftest.py's CPU settings (no compile-worker pool, plain C++ builds) kept: the same for all three runs
    env.update({k: os.environ[k] for k in ("TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_DEBUG_COMPILE",
                                           "TORCHINDUCTOR_VEC_ISA_OK") if k in os.environ})
    proc = subprocess.run([sys.executable, str(CHILD), str(limit)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = tmp_path_factory.mktemp("inductor-cache")
    return run_child(cache, 16), run_child(cache, 16), run_child(cache, 8)


def test_first_process_misses_and_runs_the_pass(runs):
    cold, _, _ = runs
    assert cold["fx_miss"] == 1 and cold["fx_hit"] == 0 and cold["fx_bypass"] == 0
    assert cold["sources"] == ["pass ran"] and cold["matches"] == {"skinny_gemm": 1}


def test_second_process_hits_and_report_still_shows_matches(runs):
    cold, warm, _ = runs
    assert warm["uuid"] == cold["uuid"], "a pass or pattern source file changed between the runs"
    assert warm["aot_hit"] + warm["fx_hit"] >= 1 and warm["fx_miss"] == 0
    assert warm["sources"] == ["cache hit (sidecar)"]
    assert warm["matches"] == {"skinny_gemm": 1}
    assert warm["op_calls"] == {"skinny_gemm": 1}       # the k3 op is what actually ran
    assert warm["checksum"] == cold["checksum"]


def test_changing_an_option_changes_the_key(runs):
    _, _, other = runs
    assert other["fx_miss"] == 1 and other["sources"] == ["pass ran"]
    assert other["matches"] == {"skinny_gemm": 1}
