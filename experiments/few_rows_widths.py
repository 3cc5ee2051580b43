"""The few-rows matmul kernel (csrc/kernels/matmul.c, decoding's N <= 16 rows) built for other
CPUs' vector widths on this one: the kernel file of the working tree and, with --against REV, of
a git revision, each compiled with the system compiler for every --march (haswell: AVX2, the
8-float halves; native: what the package builds, AVX-512 on Zen 4) into a small timing program; the programs then take turns
(--rounds rounds), each timing GPT-2 124M's layer shapes at N = 1 and 16 rows with the weight in
cache (best of 30 calls) and the lm head 768 x 50304 (streamed from memory).

Rows: label (tree or REV), march, N, C, OC, gflops. Not a test; the timing is the kernel's
alone, on --threads OpenMP threads.

    .venv/bin/python experiments/few_rows_widths.py --against 837059a --csv FILE
"""
import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
KERNELS = os.path.join(ROOT, "csrc", "kernels")
SHAPES = [(16, 768, 2304), (16, 768, 768), (16, 768, 3072), (16, 3072, 768), (1, 768, 2304),
          (16, 768, 50304)]

MAIN = r"""
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
void matmul_forward(float *out, const float *inp, const float *weight, const float *bias, int N,
		    int C, int OC);
void cblas_sgemm() { abort(); }		/* N <= 16: never called */
int main(int argc, char **argv) {
	for (int a = 1; a + 2 < argc; a += 3) {
		int N = atoi(argv[a]), C = atoi(argv[a + 1]), OC = atoi(argv[a + 2]);
		/* 16 bytes past a 64-byte line, as numpy's buffers are */
		float *in = (float *)((char *)aligned_alloc(64, 4 * (size_t)N * C + 64) + 16);
		float *w = (float *)((char *)aligned_alloc(64, 4 * (size_t)OC * C + 64) + 16);
		float *o = malloc(4 * (size_t)N * OC);
		for (size_t i = 0; i < (size_t)N * C; i++) in[i] = (float)(i % 7) - 3.0f;
		for (size_t i = 0; i < (size_t)OC * C; i++) w[i] = (float)(i % 5) - 2.0f;
		double best = 1e30;
		for (int r = 0; r < 30; r++) {
			double t = omp_get_wtime();
			matmul_forward(o, in, w, NULL, N, C, OC);
			t = omp_get_wtime() - t;
			best = t < best ? t : best;
		}
		printf("%d %d %d %.1f\n", N, C, OC, 2.0 * N * C * OC / best / 1e9);
	}
	return 0;
}
"""


def build(tmp, label, source, march):
    cc = os.environ.get("CC") or shutil.which("cc")
    stub = os.path.join(tmp, "cblas.h")
    with open(stub, "w") as f:
        f.write("void cblas_sgemm();\nenum { CblasRowMajor, CblasNoTrans, CblasTrans };\n")
    main = os.path.join(tmp, "main.c")
    with open(main, "w") as f:
        f.write(MAIN)
    exe = os.path.join(tmp, f"few_{label}_{march}")
    subprocess.run([cc, "-O3", "-fopenmp", f"-march={march}", "-DNDEBUG", "-I", tmp, "-I",
                    KERNELS, main, source, "-o", exe], check=True)
    return exe


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="a git revision whose kernel is timed beside the tree's")
    ap.add_argument("--march", nargs="+", default=["haswell", "native"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--csv", help="write the rows here (else standard output)")
    args = ap.parse_args()
    if "x86-64-v4" in args.march and " avx512f " not in open("/proc/cpuinfo").read():
        args.march.remove("x86-64-v4")
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"tree": os.path.join(KERNELS, "matmul.c")}
        if args.against:
            old = os.path.join(tmp, "matmul_old.c")
            with open(old, "w") as f:
                f.write(subprocess.run(["git", "-C", ROOT, "show",
                                        f"{args.against}:csrc/kernels/matmul.c"],
                                       capture_output=True, text=True, check=True).stdout)
            sources[args.against] = old
        exes = [(label, march, build(tmp, label, src, march))
                for label, src in sources.items() for march in args.march]
        out = open(args.csv, "w", newline="") if args.csv else sys.stdout
        w = csv.writer(out)
        w.writerow(["label", "march", "round", "N", "C", "OC", "gflops"])
        shape_args = [str(x) for s in SHAPES for x in s]
        for r in range(args.rounds):
            for label, march, exe in exes:
                text = subprocess.run([exe, *shape_args], capture_output=True, text=True,
                                      check=True, env={**os.environ,
                                                       "OMP_NUM_THREADS": str(args.threads)}).stdout
                for line in text.split("\n"):
                    if line:
                        w.writerow([label, march, r, *line.split()])
                out.flush()


if __name__ == "__main__":
    main()
