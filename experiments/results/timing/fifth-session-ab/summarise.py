"""run.sh's logs -> one CSV row per run (stdout) and each command's paired ratios (stderr).

    python3 summarise.py /tmp/ab t64 ref t1024 > ab.csv

A log holds one run after another, each ending with its 'tokens/ms over' line; the k-th run of
one build pairs with the k-th of the other (run.sh ran them in turn). Ratios are new over old
for tokens/ms (above 1: HEAD faster) and old over new for step times (likewise)."""
import re
import statistics
import sys


def runs(path):
    """[(tokens/ms, [timed steps' ms])] of one log (the first, untimed, step left out)."""
    text = open(path).read()
    chunks = text.split("tokens/ms over")
    tpm = [float(x) for x in re.findall(r"timed step\(s\): ([\d.]+)", text)]
    steps = [[float(x) for x in re.findall(r"step +\d+/\d+: train loss [\d.]+ \(([\d.]+) ms", c)][1:]
             for c in chunks[:-1]]
    return list(zip(tpm, steps))


def spread(xs):
    return f"median {statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f})"


folder = sys.argv[1]
print("command,round,build,tok_per_ms,median_step_ms,fastest_step_ms,steps_ms")
for name in sys.argv[2:]:
    old, new = runs(f"{folder}/{name}-old.log"), runs(f"{folder}/{name}-new.log")
    n = min(len(old), len(new))
    for r in range(n):
        for build, (t, s) in (("new", new[r]), ("old", old[r])):
            print(f"{name},{r + 1},{build},{t},{statistics.median(s):.1f},{min(s):.1f},"
                  f"{' '.join(map(str, s))}")
    print(f"{name}: {n} pairs; tok/ms new/old {spread([new[r][0] / old[r][0] for r in range(n)])}; "
          f"median step old/new "
          f"{spread([statistics.median(old[r][1]) / statistics.median(new[r][1]) for r in range(n)])}; "
          f"fastest step old/new {spread([min(old[r][1]) / min(new[r][1]) for r in range(n)])}",
          file=sys.stderr)
