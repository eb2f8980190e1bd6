"""What running the model in a supervised worker process costs a `fwdcheck run`, in seconds and as a ratio.

    python benchmarks/supervisor_overhead.py              # the toy config, 7 runs of each, alternating
    python benchmarks/supervisor_overhead.py --runs 15 --configs 8 CONFIG

Each run is the real command (`python -m fwdcheck run CONFIG --format json`) in a fresh interpreter, once as a default
run (supervisor + worker) and once with `--in-process`, alternating so that a change of the machine's load hits both
alike. Printed: the median wall time of each, their difference (the overhead: a second interpreter's start and the
imports it repeats, the job and the events through pipes) and the ratio. Then the same for one command given the
config `--configs` times: its first worker is a new interpreter, the later ones forks of the fork server
(fwdcheck/process/forkserver.py), so the overhead per config after the first is the fork's, printed beside a new
interpreter's (FWDCHECK_NO_FORK_SERVER=1). The medians of interleaved runs, not a timed assertion: on a loaded
machine every number moves, the differences much less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TOY = Path(__file__).resolve().parents[1] / "sample_configs" / "toy.yaml"


def wall_time(config: Path, *extra: str, copies: int = 1, env: dict | None = None) -> float:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "fwdcheck", "run", *[str(config)] * copies, "--format", "json", *extra],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    elapsed = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise SystemExit(f"fwdcheck exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", type=Path, default=TOY)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--configs", type=int, default=5, help="copies of the config in the several-config command")
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

    n = args.configs
    ways = {
        "in-process": (["--in-process"], None),
        "forked workers (default)": ([], None),
        "new interpreters": ([], {"FWDCHECK_NO_FORK_SERVER": "1"}),
    }
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.runs):
        for way, (extra, env) in ways.items():
            times[way].append(wall_time(args.config, *extra, copies=n, env=env))
    medians = {way: statistics.median(t) for way, t in times.items()}
    base = medians["in-process"]
    print(
        f"one command, the config {n} times: median wall time, and the overhead per config after the first "
        f"(the first worker is a new interpreter either way)"
    )
    for way, median in medians.items():
        extra = "" if way == "in-process" else f"  {(median - base - (a - b)) / (n - 1):+6.2f} s a config"
        print(f"  {way:<29} median {median:6.2f} s{extra}")


if __name__ == "__main__":
    main()
