"""What the default suite costs on a model that calls flex_attention, against the same model calling SDPA.

    python benchmarks/flex_cost.py --threads 1     # width 256, 2 layers, 4 heads, V=512, B=2, T=64

Two models with the same weights: one computes attention with torch.nn.attention.flex_attention and a causal BlockMask
built for each call's length (unfused on the CPU), the other with scaled_dot_product_attention(is_causal=True). For
each, the whole default run (fwdcheck.check_model) over one plain forward of the same model (eval, no_grad), both by
wall clock (median of --repeats runs), after one warm-up run of each model in the process: flex_attention's first
call sets its unfused kernel up once a process (about a second), which the second column shows apart.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fwdcheck

VOCAB = 512


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class Block(nn.Module):
    def __init__(self, width: int, heads: int, flex: bool):
        super().__init__()
        self.heads, self.flex = heads, flex
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU())
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(self.norm(x)).view(B, T, 3, self.heads, C // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # 3 x (B, h, T, d)
        if self.flex:
            mask = create_block_mask(causal, None, None, T, T, device=x.device)
            y = flex_attention(q, k, v, block_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)
        return x + self.out(self.mlp(x))


class Model(nn.Module):
    def __init__(self, width: int, layers: int, heads: int, flex: bool):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(1024, width)
        self.blocks = nn.ModuleList(Block(width, heads, flex) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids):
        T = input_ids.shape[1]
        x = self.embed(input_ids) + self.positions(torch.arange(T, device=input_ids.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ids = torch.randint(0, VOCAB, (args.batch_size, args.seq_len))
    print(
        f"width {args.width}, {args.layers} layers, {args.heads} heads, V={VOCAB}, B={args.batch_size}, "
        f"T={args.seq_len}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"{'attention':<16} {'first run s':>12} {'forward ms':>11} {'suite s':>8} {'x forward':>10}  statuses")
    for name, flex in (("flex_attention", True), ("sdpa", False)):
        model = Model(args.width, args.layers, args.heads, flex).eval()

        def run(m=model):
            return fwdcheck.check_model(m, vocab_size=VOCAB, batch_size=args.batch_size, seq_len=args.seq_len)

        first = seconds(run)  # the first run of the process pays flex_attention's one-time setup

        def plain(m=model):
            with torch.no_grad():
                m(ids)

        plain()
        forward = statistics.median(seconds(plain) for _ in range(max(5, args.repeats)))
        suite = statistics.median(seconds(run) for _ in range(args.repeats))
        statuses = ", ".join(f"{r.name} {r.status.value}" for r in run().results)
        print(f"{name:<16} {first:>12.2f} {forward * 1e3:>11.1f} {suite:>8.2f} {suite / forward:>10.1f}  {statuses}")


if __name__ == "__main__":
    main()
