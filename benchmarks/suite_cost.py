"""What the default suite costs, in forward-pass equivalents, on a GPT-2-small-sized reference model.

    python benchmarks/suite_cost.py            # d=768, 12 layers, 12 heads, V=50257, B=2, T=256
    python benchmarks/suite_cost.py --small    # a minute-long smoke version

Every number is a ratio to one plain forward of the same batch measured in this process (eval, no_grad), so it
holds on a loaded machine as well as on an idle one. Two measures per check: time / forward time, and tokens run /
tokens of one forward (the latter ignores attention's quadratic term and the observer's overhead). The naive
per-position loop (one full-batch forward per cut position) is timed on a sample of cuts and scaled to all T-1.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fwdcheck.config import config_from_dict
from fwdcheck.model import load_model
from fwdcheck.registry import select
from fwdcheck.runner import run_one
from fwdcheck.session import Session, Settings

GPT2_SMALL = dict(vocab_size=50257, d_model=768, n_heads=12, n_layers=12, d_ff=3072, max_seq_len=1024)
SMALL = dict(vocab_size=4096, d_model=128, n_heads=4, n_layers=4, d_ff=512, max_seq_len=512)


def timed(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a small model for a quick run")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--naive-sample", type=int, default=6, help="cuts timed for the naive loop")
    args = parser.parse_args()
    torch.manual_seed(0)
    fields = SMALL if args.small else GPT2_SMALL
    config = config_from_dict({"model": {"source": "reference", **fields},
                               "inputs": {"batch_size": args.batch_size, "seq_len": args.seq_len}})
    model = load_model(config)
    settings = Settings.from_config(config)
    B, T = args.batch_size, args.seq_len
    print(f"model: reference {fields}, B={B}, T={T}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")

    ids = torch.randint(0, fields["vocab_size"], (B, T))
    module = model.module.eval()
    with torch.no_grad():
        module(ids)  # warm-up
        forward = timed(lambda: module(ids))
    print(f"one plain forward: {forward * 1e3:.1f} ms\n")

    rows = []
    session = Session(model, settings)
    with session.active():
        total_time, tokens_before = 0.0, 0
        for entry in select(None):
            start = time.perf_counter()
            result = run_one(entry, model, session)
            spent = time.perf_counter() - start
            total_time += spent
            tokens = session.forward_tokens - tokens_before
            tokens_before = session.forward_tokens
            rows.append((entry.name, result.status.value, spent / forward, tokens / session.baseline_tokens))
    print(f"{'check (in suite order; shared work lands on the first that needs it)':<70} {'status':>6} "
          f"{'x fwd (time)':>13} {'x fwd (tokens)':>15}")
    for name, status, by_time, by_tokens in rows:
        print(f"{name:<70} {status:>6} {by_time:>13.2f} {by_tokens:>15.2f}")
    print(f"{'whole default suite':<70} {'':>6} {total_time / forward:>13.2f} "
          f"{session.forward_tokens / session.baseline_tokens:>15.2f}")

    cuts = torch.linspace(1, T - 1, args.naive_sample).round().long().tolist()

    def naive_cut(k: int) -> None:
        changed = ids.clone()
        changed[:, k:] = (changed[:, k:] + 1) % fields["vocab_size"]
        with torch.no_grad():
            module(changed)

    per_cut = statistics.median(timed(lambda k=k: naive_cut(k), repeat=1) for k in cuts)
    naive = per_cut * (T - 1) / forward
    future = next(r for r in rows if r[0] == "future-token")
    print(f"\nnaive per-position loop (every cut, full batch): {naive:.1f} x fwd "
          f"(timed {len(cuts)} cuts, scaled to {T - 1})")
    print(f"future-token in the suite: {future[2]:.2f} x fwd (time) -> {naive / max(future[2], 1e-9):.0f}x cheaper "
          "than the naive loop")


if __name__ == "__main__":
    main()
