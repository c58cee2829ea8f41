"""What the tensor digests of quantized checkpoints cost: load_quantized with verify=True (the
default) against verify=False, and save_quantized's digesting.

Builds the Flux transformer of benchmarks/linear_memory.py (hidden 3072, random bf16 weights;
1 double + 1 single block by default: a checkpoint of a few hundred MB), prepares it (default
config) and saves it with save_quantized. Then loads it alternately with and without
verification (best of --repeat, page cache warm, into a model load_quantized builds) and times
the digests alone (fx_fp8.quant.checkpoint.tensor_digests over every tensor of the file), which is
also what save_quantized adds. The digests (hashlib's blake2b) run on up to 8 threads.

    python benchmarks/checkpoint_digests.py [--double 1] [--single 1] [--repeat 3] [--no-results]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from linear_memory import append_section, build_flux, flux_size_arguments, timed  # noqa: E402  (one Flux builder)

import fx_fp8  # noqa: E402
from fx_fp8.quant.checkpoint import WEIGHTS_NAME, tensor_digests  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flux_size_arguments(ap, blocks=1, repeat=(3, "loads of each kind (best time kept)"))
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    from safetensors.torch import load_file
    from tabulate import tabulate

    root = tempfile.mkdtemp(prefix="fx_fp8_digests_")
    try:
        model = build_flux(args.double, args.single)
        fx_fp8.prepare_model(model)
        folder = os.path.join(root, "q")
        _, t_save = timed(lambda: fx_fp8.save_quantized(model, folder))
        del model
        path = os.path.join(folder, WEIGHTS_NAME)
        size = os.path.getsize(path)
        tensors = load_file(path)
        _, t_digest = timed(lambda: tensor_digests(tensors))
        digest_times = [t_digest]
        for _ in range(args.repeat - 1):
            digest_times.append(timed(lambda: tensor_digests(tensors))[1])
        n_tensors = len(tensors)
        del tensors
        loads = {True: [], False: []}
        fx_fp8.load_quantized(folder)  # warm the page cache and the imports
        for _ in range(args.repeat):
            for verify in (True, False):
                m, t = timed(lambda: fx_fp8.load_quantized(folder, verify=verify))
                loads[verify].append(t)
                del m
        best_on, best_off, best_digest = min(loads[True]), min(loads[False]), min(digest_times)
        rows = [
            ("load_quantized, verify=False", f"{best_off:.2f}", "-"),
            (
                "load_quantized, verify=True (default)",
                f"{best_on:.2f}",
                f"+{best_on - best_off:.2f} s (+{100 * (best_on / best_off - 1):.0f}%)",
            ),
            (
                "digests alone (what save_quantized adds)",
                f"{best_digest:.2f}",
                f"{size / 2**20 / best_digest:,.0f} MiB/s; save_quantized took {t_save:.2f} s in all",
            ),
        ]
        title = (
            f"Flux width 3072, {args.double} double + {args.single} single blocks prepared (default config): "
            f"{WEIGHTS_NAME} of {size / 2**20:,.1f} MiB, {n_tensors} tensors; best of {args.repeat}, "
            "page cache warm"
        )
        headers = ["", "seconds", "cost"]
        print(title)
        print(tabulate(rows, headers=headers))
        if not args.no_results:
            append_section("checkpoint_digests.py", title, tabulate(rows, headers=headers, tablefmt="github"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
