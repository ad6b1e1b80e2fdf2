"""The k3 custom ops, one folder each (``k3compile/ops/<op>/``). Importing an op's package
registers its ``k3::`` custom op and its ``OpImpls``; :func:`load_all` imports every one."""
from __future__ import annotations

import importlib
import pkgutil


def load_all() -> list[str]:
    """Import every op package here (registering its custom op); returns their names."""
    names = []
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg:
            importlib.import_module(f"{__name__}.{info.name}")
            names.append(info.name)
    return names
