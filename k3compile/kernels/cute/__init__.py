"""The CuTe DSL kernels (NVIDIA sm_90+): ``configs.py`` (their configurations, cutlass-free), ``compile.py`` (one
compile cache: fingerprint, variant names, fake arguments, build; cutlass imported inside its functions), and the
kernel modules it loads on first use (``mma.py``, ``mma_ring.py``, ``wgmma.py``, ``asm.py``: they import cutlass at
their top)."""
