"""k3compile: torch.compile (Inductor) graph rewrites that make a plain PyTorch Kimi K3 decode fast.

    model = k3compile.optimize(model)      # compiles in place, returns the module
    print(k3compile.report(model))
"""
__version__ = "0.1.0"

import os as _os

if _os.environ.get("K3_BUILD_WORKER") != "1":   # a kernel-build worker (workers.py) imports what its jobs need only
    from .backends import BackendUnavailableError  # noqa: E402
    from .optimize import K3PassMissingError, optimize  # noqa: E402
    from .report import Report, report  # noqa: E402

__all__ = ["optimize", "report", "Report", "BackendUnavailableError", "K3PassMissingError", "__version__"]
