"""What a default run of a Hugging Face model costs, code-path matrix included, in forward-pass equivalents.

    python benchmarks/matrix_cost.py            # GPT-2 small (124M) and a Llama-style GQA model of 8 layers
    python benchmarks/matrix_cost.py --small    # tiny widths: a quick smoke run
    python benchmarks/matrix_cost.py --threads 1 --only GPT-2

Both models are built offline from transformers configs with random weights (no hub). A default run is every check
on the default path at B x T, then every check that declares per_code_path on every cell of the code-path matrix
(fwdcheck.run.code_paths), exactly as fwdcheck.run.runner.run_model runs them: this script calls the same run_one and
run_path.

Every number is a ratio to one plain forward of the run's inputs (eval, no_grad, B x T) in the same process:
  tokens  rows x positions the checks ran (fwdcheck's own count, session.forward_tokens; pads not counted) / (B x T).
          Ignores attention's quadratic term and the observer's overhead; does not move with the machine's load.
  time    wall time / the plain forward's time, timed right before and after each check and each cell (the mean of
          the two), so that a machine whose load changes during the run still gives ratios that hold.
          Short forwards cost more time than their tokens say: every forward reads all the weights.
Shared passes (a session's observation, its baseline) land on the first check that asks for them. A cell whose
observation pass saw exactly what an earlier cell's did shares that cell's verdicts, and future-token on a cell whose
logits are those of a cell it passed on shares that pass (fwdcheck.run.code_paths): such a cell costs its observation
pass alone, and the table says whose verdict each check took.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fwdcheck.config.registry import select
from fwdcheck.config.schema import config_from_dict
from fwdcheck.model.sources import load_model
from fwdcheck.result import Status
from fwdcheck.run.code_paths import path_cells, runs_per_code_path, verdicts_for
from fwdcheck.run.matrix import shared_from
from fwdcheck.run.runner import run_one, run_path
from fwdcheck.run.session import Session
from fwdcheck.run.settings import Settings

MODELS = {
    "GPT-2 small": {"model_type": "gpt2"},  # transformers' defaults: d=768, 12 layers, 12 heads, V=50257
    "Llama-style GQA, 8 layers": {
        "model_type": "llama",
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    },
}
SMALL = {
    "GPT-2 (tiny)": {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "vocab_size": 512,
        "bos_token_id": 0,
        "eos_token_id": 0,
    },
    "Llama-style GQA (tiny)": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 512,
    },
}


def measure(name: str, hf_config: dict, B: int, T: int, cell_length: int | None) -> None:
    paths = {"seq_len": cell_length} if cell_length else {}
    config = config_from_dict(
        {"model": {"source": "hf", "config": hf_config}, "inputs": {"batch_size": B, "seq_len": T}, "code_paths": paths}
    )
    model = load_model(config)
    settings = Settings.from_config(config)
    parameters = sum(p.numel() for p in model.module.parameters())
    module = model.module.eval()
    ids = torch.randint(0, model.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    tokens_per_forward = B * T

    def plain() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            module(ids)
        return time.perf_counter() - start

    plain()  # warm-up
    forward_times = [plain()]

    def phase(run):
        """run() timed, as a ratio to the plain forwards timed just before and just after it."""
        start = time.perf_counter()
        value = run()
        spent = time.perf_counter() - start
        forward_times.append(plain())
        return value, spent / ((forward_times[-2] + forward_times[-1]) / 2)

    entries = select(None)
    default_rows, cell_rows = [], []
    session = Session(model, settings)
    cells = path_cells(model, settings.code_paths, settings.inputs.batch_size)
    with session.active():
        before = 0
        results = []
        for entry in entries:
            result, by_time = phase(lambda: run_one(entry, model, session))  # noqa: B023 -- called here, at once
            results.append(result)
            default_rows.append((entry.name, result.status.value, by_time, session.forward_tokens - before))
            before = session.forward_tokens
        # As runner.run_code_paths: the per-path checks that ran on the default path, once per cell.
        per_path = [
            e
            for e, r in zip(entries, results, strict=True)
            if r.status not in (Status.SKIP, Status.ERROR) and runs_per_code_path(e.load())
        ]
        verdicts = verdicts_for(model)  # as run_code_paths: what the cells run so far vouch for, for later cells
        for cell in cells if per_path else []:
            # noqa B023 below: the lambda is called here, at once, not after the loop has moved on
            cell_rows.append(phase(lambda: run_path(cell, per_path, model, settings, session, verdicts)))  # noqa: B023

    def ratio(by_time: float, tokens: int) -> str:
        return f"{by_time:>9.2f} {tokens / tokens_per_forward:>9.2f}"

    print(
        f"\n== {name}: {parameters / 1e6:.0f}M parameters, B={B}, T={T}; one plain forward "
        f"{statistics.median(forward_times) * 1e3:.1f} ms (median; {min(forward_times) * 1e3:.0f} to "
        f"{max(forward_times) * 1e3:.0f} ms over the run)"
    )
    print(f"{'':<62} {'status':>6} {'x fwd time':>9} {'x tokens':>9}")
    print("default path (B x T)")
    for check, status, by_time, tokens in default_rows:
        print(f"  {check:<60} {status:>6} {ratio(by_time, tokens)}")
    default_time = sum(r[2] for r in default_rows)
    default_tokens = sum(r[3] for r in default_rows)
    print(f"  {'all checks':<60} {'':>6} {ratio(default_time, default_tokens)}")

    matrix_time = sum(by_time for _, by_time in cell_rows)
    matrix_tokens = sum(sum(run.forward_tokens) for run, _ in cell_rows)
    if cell_rows:
        print(
            f"code-path matrix: {len(cell_rows)} cells; per-path checks: {', '.join(e.name for e in per_path)} "
            "(time: the cell's, shared)"
        )
        for j, entry in enumerate(per_path):
            statuses = {run.results[j].status.value for run, _ in cell_rows}
            tokens = sum(run.forward_tokens[j] for run, _ in cell_rows)
            print(
                f"  {entry.name + ' (all cells)':<60} {'/'.join(sorted(statuses)):>6} {'':>9} "
                f"{tokens / tokens_per_forward:>9.2f}"
            )
        for run, by_time in cell_rows:
            label = f"{run.cell.label} (T={run.seq_len})"
            statuses = "/".join(sorted({r.status.value for r in run.results}))
            split = ", ".join(
                f"{e.name} {t / tokens_per_forward:.3f}" for e, t in zip(per_path, run.forward_tokens, strict=True)
            )
            hows = verdicts_taken(run)
            shared = (
                hows[0]
                if all(h and h == hows[0] for h in hows)
                else "; ".join(f"{e.name}: {how}" for e, how in zip(per_path, hows, strict=True) if how)
            )
            print(
                f"  {label:<60} {statuses:>6} {ratio(by_time, sum(run.forward_tokens))}   tokens: {split}"
                + (f"   shares: {shared}" if shared else "")
            )
        ran = sum(1 for run, _ in cell_rows for how in verdicts_taken(run) if not how)
        print(
            f"  {'whole matrix':<60} {'':>6} {ratio(matrix_time, matrix_tokens)}   "
            f"({ran} of {len(cell_rows) * len(per_path)} check x cell verdicts measured, the others shared)"
        )
    print(
        f"{'whole default run (default path + matrix)':<62} {'':>6} "
        f"{ratio(default_time + matrix_time, default_tokens + matrix_tokens)}"
    )
    if cell_rows:
        # What the matrix would cost as a per-position loop: every cell at full length, one forward per cut.
        naive = sum(c.batch_size for c in cells) * T * (T - 1) / tokens_per_forward
        print(
            f"{'naive matrix: every cell at T, one forward per cut (counted, not run)':<62} "
            f"{'':>6} {'':>9} {naive:>9.0f}"
        )


def verdicts_taken(run) -> list[str]:
    """Per check of a cell: "" when it ran its own comparisons, else whose verdict it took and by which rule."""
    return [f"{shared.by} of {shared.cell}" if (shared := shared_from(run, r)) else "" for r in run.results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny widths for a quick run")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--cell-length", type=int, default=None, help="paths.seq_len: tokens per row in each cell")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads (default: torch's own choice); 1 keeps the ratios those of suite_cost.py "
        "--threads 1, and honest on a shared machine",
    )
    parser.add_argument("--only", help="measure only the models whose name contains this")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()  # the same notices for every cell would drown the table
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads")
    for name, hf_config in (SMALL if args.small else MODELS).items():
        if args.only and args.only not in name:
            continue
        measure(name, hf_config, args.batch_size, args.seq_len, args.cell_length)


if __name__ == "__main__":
    main()
