"""Stand-ins the tests put into a golden module's namespace."""


class NoNative:
    """Stands in for ``hbfp.golden.native`` where a module (bfp, gemm) calls it: the compiled
    kernels unavailable, so that module takes its NumPy path."""

    @staticmethod
    def available():
        return False
