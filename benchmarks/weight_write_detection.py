"""Can a compiled graph see, per call, a weight written in place through `.data` (EMA's copy_to,
PEFT's merge, `w.data.add_(d)`)? Such a write bumps no version counter the per-call check reads, so
only the bytes tell. What each way of looking costs per graph call, beside what the check costs today:

  * today: the fingerprint of every weight the graph quantized (object, version, address, dtype,
    device, shape) compared with its copy's (fx_fp8/quant/weight_feeds.py), no byte read;
  * a byte digest of every weight (fx_fp8.quant.weight_state.digests: what refresh_weights reads),
    one device-to-host copy;
  * a sampled fingerprint: `--samples` elements of every weight gathered at fixed positions and
    compared on the device, one device-to-host read of the verdict (it misses a write that
    touches none of them);
  * the followed writers' count (fx_fp8/quant/weight_writers.py): one integer comparison.

    python benchmarks/weight_write_detection.py [--weights 12] [--rows 1024] [--cols 4096] [--samples 8]
"""

from __future__ import annotations

import argparse
import time

import torch

from fx_fp8.quant.weight_state import digests, fingerprint
from fx_fp8.quant.weight_writers import WRITES


def best_us(fn, calls: int, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, 1e6 * (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", type=int, default=12)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    weights = [
        torch.nn.Parameter(
            torch.randn(args.rows, args.cols, generator=gen).to(args.device, torch.bfloat16), requires_grad=False
        )
        for _ in range(args.weights)
    ]
    mib = sum(w.numel() * w.element_size() for w in weights) / 2**20

    seen = [fingerprint(w) for w in weights]
    today = best_us(lambda: all(fingerprint(w) == s for w, s in zip(weights, seen)), 2000)

    digest_us = best_us(lambda: digests(weights), 3, rounds=3)

    index = torch.randint(0, args.rows * args.cols, (args.samples,), generator=gen).to(args.device)
    sampled = torch.stack([w.detach().view(-1)[index] for w in weights])

    def sample_check():
        now = torch.stack([w.detach().view(-1)[index] for w in weights])
        return bool(torch.equal(now, sampled))  # the verdict read on the host: a sync on a GPU

    sample_us = best_us(sample_check, 200)
    count = WRITES.count
    writers_us = best_us(lambda: WRITES.count == count, 100000)

    n = args.weights
    print(f"{n} weights of {args.rows}x{args.cols} bf16 ({mib:.0f} MiB) on {args.device}, torch {torch.__version__}")
    print("| per graph call | µs | µs per weight | µs per MiB |")
    print("|---|---|---|---|")
    for name, us in (
        ("today: fingerprints", today),
        ("byte digest of every weight", digest_us),
        (f"sampled fingerprint ({args.samples} elements per weight)", sample_us),
        ("followed writers' count", writers_us),
    ):
        print(f"| {name} | {us:.2f} | {us / n:.3f} | {us / mib:.3f} |")


if __name__ == "__main__":
    main()
