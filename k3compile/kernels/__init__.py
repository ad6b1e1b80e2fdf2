"""Kernel code several ops share (``cute/``: the CuTe DSL skinny GEMM kernels, their configurations and their
compile cache). Imports no op."""
