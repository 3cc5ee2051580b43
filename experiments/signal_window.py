"""When, after a command starts, its stop signals are handled: Python's own SIGINT handler (a
Ctrl-C is then a KeyboardInterrupt) and starpu-llm's handlers (SIGUSR1 caught: from Python's
site on, tools/00-starpu-llm-start.pth), read from /proc/PID/status while the process starts.
docs/robustness.md quotes it.

    python experiments/signal_window.py [--starts N] COMMAND [ARGS...]
    python experiments/signal_window.py .venv/bin/starpu-llm --version
"""
import argparse
import signal
import statistics
import subprocess
import time


def caught(pid: int) -> int:
    """The process's caught-signals mask (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return int(line.split()[1], 16)
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--starts", type=int, default=30)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    python, ours = [], []
    for _ in range(args.starts):
        t0 = time.perf_counter()
        p = subprocess.Popen(args.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        at_python = None
        while p.poll() is None:
            mask, t = caught(p.pid), (time.perf_counter() - t0) * 1e3
            if at_python is None and mask & (1 << (signal.SIGINT - 1)):
                at_python = t
            if mask & (1 << (signal.SIGUSR1 - 1)):
                python.append(at_python if at_python is not None else t)
                ours.append(t)
                break
        p.kill()
        p.wait()
    if not ours:
        raise SystemExit("signal_window: the command never caught SIGUSR1 (not starpu-llm?)")
    gap = [o - p for o, p in zip(ours, python)]
    print(f"{len(ours)} starts: Python's SIGINT handler at {statistics.median(python):.1f} ms "
          f"(median), starpu-llm's handlers at {statistics.median(ours):.1f} ms (min "
          f"{min(ours):.1f}, max {max(ours):.1f}); between them {statistics.median(gap):.1f} ms "
          f"(max {max(gap):.1f})")


if __name__ == "__main__":
    main()
