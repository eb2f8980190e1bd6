"""What a run over a 2-D mesh costs against the same checks on one process, in seconds and as a ratio.

    python benchmarks/mesh_cost.py               # 5 runs of each, alternating
    python benchmarks/mesh_cost.py --runs 9

The model is the small GPT of tests/distributed_models.py. Sharded: `distributed: {mesh: {dp_shard: 2, tp: 2}}`, 4
CPU ranks with gloo, tensor parallel over `tp` and FSDP2 over `dp_shard` (`tp_fsdp`), the sharding check first, then
the default checks. On one process: the same model and the same default checks, nothing sharded. Each run is the
real command (`python -m fwdcheck run CONFIG --format json`) in a fresh interpreter, the two alternating so that a
change of the machine's load hits both alike. Printed: the median wall time of each, their difference (the ranks'
start, the rendezvous, the sharding and the collectives of every forward, the sharding check's unsharded forward)
and the ratio. The medians of interleaved runs, not a timed assertion.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def config(sharded: bool) -> dict:
    model = {"source": "python", "factory": "tests.distributed_models:gpt", "path": [str(REPO)]}
    document: dict = {"model": model, "inputs": {"batch_size": 2, "seq_len": 8}}
    if sharded:
        document["distributed"] = {
            "mesh": {"dp_shard": 2, "tp": 2},
            "parallelize": "tests.distributed_models:tp_fsdp",
        }
    return document


def wall_time(path: Path) -> float:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "fwdcheck", "run", str(path), "--format", "json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=os.environ.copy(),
    )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"fwdcheck exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mesh, one = Path(folder) / "mesh.yaml", Path(folder) / "one.yaml"
        mesh.write_text(yaml.safe_dump(config(sharded=True)))
        one.write_text(yaml.safe_dump(config(sharded=False)))
        wall_time(one)  # warm the file cache: the first interpreter start reads torch from disk
        sharded, single = [], []
        for _ in range(args.runs):
            sharded.append(wall_time(mesh))
            single.append(wall_time(one))
    a, b = statistics.median(sharded), statistics.median(single)
    print(f"{args.runs} runs of each, interleaved, {os.cpu_count()} CPUs")
    print(f"  one process (nproc 1)               median {b:6.2f} s")
    print(f"  4 ranks, mesh dp_shard 2 x tp 2     median {a:6.2f} s")
    print(f"  difference                          {a - b:+6.2f} s  ({a / b:.2f}x)")


if __name__ == "__main__":
    main()
