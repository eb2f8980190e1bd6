"""What the default suite costs, in forward-pass equivalents and in peak memory, on a GPT-2-small-sized reference model.

    python benchmarks/suite_cost.py --threads 1                 # d=768, 12 layers, 12 heads, V=50257, B=2, T=128
    python benchmarks/suite_cost.py --threads 1 --seq-len 512
    python benchmarks/suite_cost.py --small                     # a seconds-long smoke version

Every number is a ratio to one plain forward of the same batch (eval, no_grad) measured in the same process. Three
measures per check: wall-clock time and CPU time (this process's, all threads) over the forward's, and tokens run
over the forward's tokens. Tokens ignore attention's quadratic term, the observer's overhead and what a forward costs
whatever its length (every forward reads all the weights: on CPU a 16-token forward of this model takes a quarter of
the time of a 256-token one). On a shared machine the wall clock counts other processes' work too, and with several
threads so does the CPU time (threads waiting for a core spin); with --threads 1 both hold. The naive per-position
loop (one full-batch forward per cut position) is timed on a sample of cuts and scaled to all T-1.

Peak memory is the resident set (RSS) on CPU, measured in a fresh process per measurement, so that neither sees the
other's high-water mark: each builds the model and runs one warm-up forward, then resets the kernel's high-water mark
(VmHWM, by writing 5 to /proc/self/clear_refs) and runs either one plain forward or the whole default run. Two ratios:
of the peaks themselves (weights, torch and Python included, as CUDA's max_memory_allocated counts weights) and of
the peaks above what was resident before (what the forward or the run added: activations, logits, kept results).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

from fwdcheck.config.registry import select
from fwdcheck.config.schema import config_from_dict
from fwdcheck.model.sources import load_model
from fwdcheck.run.runner import run_model, run_one
from fwdcheck.run.session import Session
from fwdcheck.run.settings import Settings

GPT2_SMALL = dict(vocab_size=50257, d_model=768, n_heads=12, n_layers=12, d_ff=3072, max_seq_len=1024)
SMALL = dict(vocab_size=4096, d_model=128, n_heads=4, n_layers=4, d_ff=512, max_seq_len=512)


def timed(fn) -> tuple[object, float, float]:
    """What one call returns, and its wall-clock and CPU seconds (this process, all its threads)."""
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return value, time.perf_counter() - wall, time.process_time() - cpu


def build(args):
    """The model, its settings and the plain forward's input, the same in every process."""
    torch.manual_seed(0)
    fields = SMALL if args.small else GPT2_SMALL
    config = config_from_dict(
        {"model": {"source": "reference", **fields}, "inputs": {"batch_size": args.batch_size, "seq_len": args.seq_len}}
    )
    model = load_model(config)
    ids = torch.randint(0, fields["vocab_size"], (args.batch_size, args.seq_len))
    return fields, model, Settings.from_config(config), ids


# -- forward-pass equivalents ----------------------------------------------------------------------------------------


def cost(args) -> None:
    fields, model, settings, ids = build(args)
    B, T = args.batch_size, args.seq_len
    print(f"model: reference {fields}, B={B}, T={T}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    module = model.module.eval()

    def plain() -> None:
        with torch.no_grad():
            module(ids)

    plain()  # warm-up
    before = [timed(plain)[1:] for _ in range(3)]

    rows = []
    session = Session(model, settings)
    default = {entry.name for entry in select(None)}
    with session.active():
        tokens_before = 0
        # every registered check, as `checks: [all]` runs them: the default ones first, the others after them, so
        # that each of those is charged only what it adds to a default run
        for entry in sorted(select(["all"]), key=lambda e: e.name not in default):
            result, *spent = timed(lambda: run_one(entry, model, session))  # noqa: B023 -- called here, at once
            tokens = session.forward_tokens - tokens_before
            tokens_before = session.forward_tokens
            rows.append((entry.name, result.status.value, spent, tokens / session.baseline_tokens))
    # The plain forward is timed before and after the suite, and every ratio is given by wall-clock and by CPU time:
    # on a shared machine the wall clock counts other processes' work too (a spread before/after shows it), the CPU
    # time of this process much less.
    after = [timed(plain)[1:] for _ in range(3)]
    wall = statistics.median(w for w, _ in before + after)
    cpu = statistics.median(c for _, c in before + after)
    print(
        f"one plain forward: {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU (median of 6; wall before the suite "
        f"{min(w for w, _ in before) * 1e3:.0f}-{max(w for w, _ in before) * 1e3:.0f} ms, after "
        f"{min(w for w, _ in after) * 1e3:.0f}-{max(w for w, _ in after) * 1e3:.0f} ms)\n"
    )
    print(
        f"{'check (in suite order; shared work lands on the first that needs it)':<58} {'status':>6} "
        f"{'x fwd (wall)':>13} {'x fwd (CPU)':>12} {'x fwd (tokens)':>15}"
    )
    for name, status, (w, c), by_tokens in rows:
        if name not in default and name == next(r[0] for r in rows if r[0] not in default):
            print("not in the default selection (checks: [default, NAME]), each after the default suite:")
        print(f"{name:<58} {status:>6} {w / wall:>13.2f} {c / cpu:>12.2f} {by_tokens:>15.2f}")
    suite = [r for r in rows if r[0] in default]
    total_wall, total_cpu = sum(r[2][0] for r in suite), sum(r[2][1] for r in suite)
    print(
        f"{'whole default suite':<58} {'':>6} {total_wall / wall:>13.2f} {total_cpu / cpu:>12.2f} "
        f"{sum(r[3] for r in suite):>15.2f}"
    )
    # What `fwdcheck run` spends besides the checks: the session's setup, putting the model back, and the parameter
    # fingerprints before and after the checks (FWD006), as run_model does them; and the same run without the
    # code-path matrix's train cell (code_paths: {train: false}), what the cell costs. Each is run `--repeats` times,
    # interleaved, each run's time over the plain forwards timed just before and after it; the medians are printed
    # (one run on a shared machine moves by several percent).
    no_train = settings.with_config(code_paths=settings.code_paths.model_copy(update={"train": False}))
    with_cell, without_cell = [], []
    for _ in range(args.repeats):
        for runs, chosen in ((with_cell, settings), (without_cell, no_train)):
            around = [timed(plain)[1:]]
            report, *spent = timed(lambda s=chosen: run_model(model, s, select(None)))
            around.append(timed(plain)[1:])
            assert all(r.status.value == "pass" for r in report.results), [r.summary for r in report.results]
            forward = [statistics.mean(w for w, _ in around), statistics.mean(c for _, c in around)]
            runs.append((spent[0] / forward[0], spent[1] / forward[1]))
    whole = [statistics.median(r[i] for r in with_cell) for i in (0, 1)]
    lean = [statistics.median(r[i] for r in without_cell) for i in (0, 1)]
    print(
        f"{'whole run (run_model: + setup, restore, fingerprints)':<58} {'':>6} {whole[0]:>13.2f} {whole[1]:>12.2f}"
        f"   (median of {args.repeats}; CPU {min(r[1] for r in with_cell):.2f}-{max(r[1] for r in with_cell):.2f})"
    )
    print(
        f"{'  of which the train path cell (the run again without it)':<58} {'':>6} "
        f"{whole[0] - lean[0]:>13.2f} {whole[1] - lean[1]:>12.2f}"
    )

    cuts = torch.linspace(1, T - 1, args.naive_sample).round().long().tolist()

    def naive_cut(k: int) -> None:
        changed = ids.clone()
        changed[:, k:] = (changed[:, k:] + 1) % fields["vocab_size"]
        with torch.no_grad():
            module(changed)

    per_cut = [timed(lambda k=k: naive_cut(k))[1:] for k in cuts]
    naive_wall = statistics.median(w for w, _ in per_cut) * (T - 1) / wall
    naive_cpu = statistics.median(c for _, c in per_cut) * (T - 1) / cpu
    future = next(r for r in rows if r[0] == "future-token")
    print(
        f"\nnaive per-position loop (every cut, full batch): {naive_wall:.1f} x fwd wall, {naive_cpu:.1f} x fwd CPU "
        f"(timed {len(cuts)} cuts, scaled to {T - 1})"
    )
    print(
        f"future-token in the suite: {future[2][1] / cpu:.2f} x fwd (CPU) -> "
        f"{naive_cpu / max(future[2][1] / cpu, 1e-9):.0f}x cheaper than the naive loop"
    )


# -- peak memory -----------------------------------------------------------------------------------------------------


def resident_kb() -> dict[str, int]:
    with open("/proc/self/status") as file:
        status = file.read()
    return {key: int(value) for key, value in re.findall(r"(VmHWM|VmRSS):\s+(\d+) kB", status)}


def peak(args) -> None:
    """In its own process: the high-water mark of one plain forward, or of the whole default run, as JSON."""
    _, model, settings, ids = build(args)
    module = model.module.eval()
    with torch.no_grad():
        module(ids)  # warm-up: one-time allocations (thread pools, kernels' workspaces) land before the reset
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the high-water mark restarts from what is resident now
    before = resident_kb()["VmRSS"]
    if args.peak == "plain":
        with torch.no_grad():
            module(ids)
    else:
        run_model(model, settings, select(None))
    print(json.dumps({"before_kb": before, "peak_kb": resident_kb()["VmHWM"]}))


def memory(args) -> None:
    if not os.path.exists("/proc/self/clear_refs"):
        print("\npeak RSS: not measured (it reads and resets the high-water mark through Linux's /proc)")
        return
    measured = {}
    for what in ("plain", "suite"):
        command = (
            [
                sys.executable,
                __file__,
                "--peak",
                what,
                "--seq-len",
                str(args.seq_len),
                "--batch-size",
                str(args.batch_size),
            ]
            + (["--small"] if args.small else [])
            + (["--threads", str(args.threads)] if args.threads else [])
        )
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        measured[what] = json.loads(output.strip().splitlines()[-1])
    plain, suite = measured["plain"], measured["suite"]
    mb = 1 / 1024
    print(
        f"\npeak RSS, each in a fresh process after one warm-up forward (MB): one plain forward "
        f"{plain['peak_kb'] * mb:.0f}, default run {suite['peak_kb'] * mb:.0f} -> "
        f"{suite['peak_kb'] / plain['peak_kb']:.2f} x"
    )
    added_plain = plain["peak_kb"] - plain["before_kb"]
    added_suite = suite["peak_kb"] - suite["before_kb"]
    print(
        f"  above what was resident before (model, torch): plain forward +{added_plain * mb:.0f}, "
        f"default run +{added_suite * mb:.0f} -> {added_suite / max(added_plain, 1):.2f} x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a small model for a quick run")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--naive-sample", type=int, default=6, help="cuts timed for the naive loop")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads (default: torch's own choice); 1 keeps "
        "CPU time honest on a shared machine, where waiting threads spin",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of the whole run timed, the median printed")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--peak", choices=["plain", "suite"], help=argparse.SUPPRESS)  # one memory measurement
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.peak:
        peak(args)
        return
    cost(args)
    if not args.no_memory:
        memory(args)


if __name__ == "__main__":
    main()
