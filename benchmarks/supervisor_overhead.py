"""What running the model in a supervised worker process costs a `fwdcheck run`, in seconds and as a ratio.

    python benchmarks/supervisor_overhead.py              # the toy config, 7 runs of each, alternating
    python benchmarks/supervisor_overhead.py --runs 15 CONFIG

Each run is the real command (`python -m fwdcheck run CONFIG --format json`) in a fresh interpreter, once as a default
run (supervisor + worker) and once with `--in-process`, alternating so that a change of the machine's load hits both
alike. Printed: the median wall time of each, their difference (the overhead: a second interpreter's start and the
imports it repeats, the job and the events through pipes) and the ratio. The medians of interleaved runs, not a timed
assertion: on a loaded machine every number moves, the difference much less.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

TOY = Path(__file__).resolve().parents[1] / "sample_configs" / "toy.yaml"


def wall_time(config: Path, *extra: str) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "fwdcheck", "run", str(config), "--format", "json", *extra],
                          capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise SystemExit(f"fwdcheck exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", type=Path, default=TOY)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    wall_time(args.config)  # warm the file cache: the first interpreter start reads torch from disk
    supervised, in_process = [], []
    for _ in range(args.runs):
        supervised.append(wall_time(args.config))
        in_process.append(wall_time(args.config, "--in-process"))
    a, b = statistics.median(supervised), statistics.median(in_process)
    print(f"config: {args.config.name}, {args.runs} runs of each, interleaved")
    print(f"  in-process (--in-process)     median {b:6.2f} s")
    print(f"  supervised worker (default)   median {a:6.2f} s")
    print(f"  overhead                      {a - b:+6.2f} s  ({a / b:.2f}x)")


if __name__ == "__main__":
    main()
