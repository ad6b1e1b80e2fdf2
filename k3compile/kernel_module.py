"""Kernel modules imported on first use (``KernelModule``): what keeps Triton, CuTe DSL and fla out of ``import
k3compile`` and out of every op's ``dispatch.py``."""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable, Optional

from .backends import BackendUnavailableError, Reason, triton_importable


class KernelModule:
    """A kernel module (Triton, CuTe DSL, fla) that imports its package at the top, imported on first use.

    An op's ``dispatch.py`` reaches its kernels through one of these instead of importing the module, so
    ``import k3compile`` and every ``k3::`` op work on a machine without the package. The ``available`` predicate
    of the implementation adds :meth:`reason` (after its device checks, so nothing is imported where the kernel
    could not run anyway): where the module does not import, dispatch records why as the fallback reason and a
    forced backend raises. :meth:`predicate` callables return that reason too; everything else raises
    :class:`BackendUnavailableError` (dispatch reads that as the reason as well, see ``OpImpls.decide``).

        _TRITON = KernelModule("k3compile.ops.kda_decode.triton")
        _TRITON.reason()                                          # None, or why it does not import
        _TRITON.kda_decode_triton(*args)                          # imports on first call
        supports = _TRITON.predicate("supports")                  # the reason string where it does not import
    """

    def __init__(self, name: str, requires: Callable[[], Reason] = triton_importable):
        self.name = name
        self.requires = requires      # the package's own check, run first (its reason names the package)
        self._loaded: Optional[ModuleType | str] = None

    def _load(self) -> ModuleType | str:
        if self._loaded is None:
            loaded = self.requires()
            if loaded is None:
                try:
                    loaded = importlib.import_module(self.name)
                except Exception as e:
                    loaded = f"{self.name} does not import ({type(e).__name__}: {e})"
            self._loaded = loaded
        return self._loaded

    def reason(self) -> Reason:
        """None where the module imports, else why not."""
        loaded = self._load()
        return loaded if isinstance(loaded, str) else None

    def module(self) -> ModuleType:
        loaded = self._load()
        if isinstance(loaded, str):
            raise BackendUnavailableError(loaded)
        return loaded

    def __getattr__(self, attr: str) -> Callable[..., Any]:
        if attr.startswith("_"):
            raise AttributeError(attr)

        def call(*args, **kwargs):
            return getattr(self.module(), attr)(*args, **kwargs)
        call.__name__ = call.__qualname__ = attr
        return call

    def predicate(self, attr: str) -> Callable[..., Reason]:
        """The module's predicate ``attr``; where the module does not import, a predicate that returns why."""
        def check(*args, **kwargs) -> Reason:
            return self.reason() or getattr(self.module(), attr)(*args, **kwargs)
        check.__name__ = check.__qualname__ = attr
        return check
