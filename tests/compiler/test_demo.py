"""The README's first command, ``python -m k3compile.demo``, on a CPU machine without Triton, CuTe DSL or fla: a
subprocess in which importing them fails (as where they are not installed) runs the demo module; it must finish,
decode eager's tokens, and say what ran where (the passes stood down on the CPU, and why).

One subprocess compiling the micro model's prefill and decode graphs (Inductor's on-disk cache, where warm from an
earlier run, serves them in seconds).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

BLOCKED = ("triton", "cutlass", "fla")

# None in sys.modules makes ``import x`` raise ModuleNotFoundError and importlib.util.find_spec(x) return None,
# exactly as for a package that is not installed (torch itself checks both).
RUN_WITHOUT = """
import runpy, sys
for name in {blocked!r}:
    sys.modules[name] = None
sys.argv = ["k3compile.demo", *{argv!r}]
runpy.run_module("k3compile.demo", run_name="__main__", alter_sys=True)
"""


def test_demo_runs_without_triton_cute_or_fla():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # a user's shell has no interpreter
    code = RUN_WITHOUT.format(blocked=BLOCKED, argv=["--tokens", "3", "--prompt-len", "4"])
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "ModuleNotFoundError" not in out
    assert "eager:" in out and "tokens agree with eager decoding" in out
    # progress on the long part, and what ran where and why
    assert "k3compile: compiling graph 0 (prefill, batch 1, 4 tokens)" in out
    assert "graph 1 (decode, batch 1)" in out
    assert "compiled as plain torch.compile" in out and "no k3 kernel runs" in out
