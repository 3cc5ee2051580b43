"""layernorm_forward at (N, C) = (8192, 768) in one process, on one thread (OMP_NUM_THREADS=1):
the fastest and the median of R timed calls, ms (run by each build's .venv/bin/python in turn)."""
import sys, time
import numpy as np
from starpu_llm._kernels import ffi, lib
N, C, R = 8192, 768, int(sys.argv[1]) if len(sys.argv) > 1 else 40
rng = np.random.default_rng(0)
x = rng.standard_normal((N, C), dtype=np.float32) * 2 + 0.5
w = rng.standard_normal(C, dtype=np.float32); b = rng.standard_normal(C, dtype=np.float32)
out = np.empty((N, C), np.float32); mean = np.empty(N, np.float32); rstd = np.empty(N, np.float32)
p = lambda a: ffi.cast("float *", a.ctypes.data)
args = [p(out), p(mean), p(rstd), p(x), p(w), p(b), N, C]
for _ in range(3):
    lib.layernorm_forward(*args)
ts = []
for _ in range(R):
    t = time.perf_counter(); lib.layernorm_forward(*args); ts.append((time.perf_counter() - t) * 1e3)
ts.sort()
print(f"{ts[0]:.3f} {ts[len(ts)//2]:.3f}")
