#!/usr/bin/env python
"""The supported-models table: every zoo transformer, native vs backend="fp8" with default options.

Each class of `fx_fp8.tools.zoo` (tiny random diffusers transformers, built with seed 0) runs
natively and under `torch.compile(model, backend="fp8")` with no options (FP8 attention and FP8
linears, the defaults) on CPU, the reference lowering; the error is the relative L2 error of the
output against native, averaged over --inputs input seeds (size variant 1). The report gives how
many attention and linear nodes run FP8 and why the others stay native.

    python benchmarks/supported_models.py                                   # print the table
    python benchmarks/supported_models.py --out docs/supported_models.md    # write the docs page
    python benchmarks/supported_models.py --out docs/supported_models.md --readme README.md
    python benchmarks/supported_models.py --models flux wan --inputs 1
    python benchmarks/supported_models.py --merge --models flux3 --out docs/supported_models.md --readme README.md

--readme rewrites only the block between `<!-- supported-models -->` and
`<!-- /supported-models -->` in the given file. Nothing is written without --out / --readme.
--merge measures only --models and merges their rows into the existing --out page (the other rows
stay as they were measured; counts, largest error and the lists under the table are recomputed) and
the counts of the --readme sentence: for new zoo classes when the whole run (10+ minutes) is too long.
The weights are random: the errors show that FP8 applies and stays bounded, not the quality of a
trained checkpoint.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import platform
import re
import sys
import time
import warnings

import torch

import fx_fp8
from fx_fp8.tools.model_zoo import registry as zoo
from fx_fp8.tools.model_zoo.registry import FAMILIES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from defaults_zoo import rel_err  # noqa: E402  (one definition of the error)

START, END = "<!-- supported-models -->", "<!-- /supported-models -->"

#: short labels for the reasons a node stays native (first match wins; the report has the full text)
_REASONS = [
    (r"timestep conditioning", "timestep embedders"),
    (r"adaLN modulation", "adaLN modulation"),
    (r"final projection", "final projection"),
    (r"known sensitive layer", "sensitive by name"),
    (r"ignored_layers", "ignored_layers"),
    (r"min_features", "below min_features"),
    (r"not multiples of 16", "features not multiples of 16"),
    (r"cross-attention", "short cross-attention"),
    (r"mask", "attention mask"),
]


def _label(reason: str) -> str:
    for pattern, label in _REASONS:
        if re.search(pattern, reason, re.IGNORECASE):
            return label
    return reason.split(";")[0].split("(")[0].strip()


#: the five families at their real width (the released checkpoints' configs: hidden size, heads, head
#: dim, feed-forward and text widths), with one block of each kind (Flux: one double- and one
#: single-stream block; Z-Image: one noise / context refiner and one joint layer) instead of tens
REAL_WIDTH = {
    "flux": (
        "FLUX.1-dev",
        dict(
            patch_size=1,
            in_channels=64,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        ),
    ),
    "qwen-image": (
        "Qwen-Image",
        dict(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=1,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=3584,
            axes_dims_rope=(16, 56, 56),
        ),
    ),
    "sd3": (
        "SD3.5-large",
        dict(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            num_layers=1,
            attention_head_dim=64,
            num_attention_heads=38,
            joint_attention_dim=4096,
            caption_projection_dim=2432,
            pooled_projection_dim=2048,
            out_channels=16,
            pos_embed_max_size=192,
            qk_norm="rms_norm",
        ),
    ),
    "z-image": (
        "Z-Image-Turbo",
        dict(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=16,
            dim=3840,
            n_layers=1,
            n_refiner_layers=1,
            n_heads=30,
            n_kv_heads=30,
            norm_eps=1e-5,
            qk_norm=True,
            cap_feat_dim=2560,
            rope_theta=256.0,
            t_scale=1000.0,
            axes_dims=[32, 48, 48],
            axes_lens=[1536, 512, 512],
        ),
    ),
    "wan": (
        "Wan2.1-T2V-14B",
        dict(
            patch_size=(1, 2, 2),
            num_attention_heads=40,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=13824,
            num_layers=1,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=1024,
        ),
    ),
}
#: real-width runs: bfloat16 (the checkpoints' dtype; half the memory), a few tokens
REAL_DTYPE = torch.bfloat16


def build_real_width(family: str, seed: int = 0) -> torch.nn.Module:
    """A random-weight `family` transformer at REAL_WIDTH, zero-initialised layers made random as in the zoo."""
    from diffusers.utils import logging as dlogging

    from fx_fp8.tools.model_zoo.instantiate import diffusers_class as _cls
    from fx_fp8.tools.model_zoo.registry import MODELS, _to_dtype, reinit_zero_layers

    verbosity = dlogging.get_verbosity()
    dlogging.set_verbosity_error()  # silence "modules that should be kept in float32" on .to(dtype), as the zoo does
    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            torch.manual_seed(seed)
            model = _cls(MODELS[family].class_name)(**REAL_WIDTH[family][1])
            reinit_zero_layers(model)
            return _to_dtype(model, REAL_DTYPE).eval()
    finally:
        dlogging.set_verbosity(verbosity)


def real_width_inputs(family: str, model, seed: int) -> dict:
    """The family's own input maker at its default size (64 image tokens, 12-16 text tokens; Wan 2 frames)."""
    from fx_fp8.tools.model_zoo.registry import MODELS

    kw = MODELS[family].family.inputs(model.config, 1, torch.Generator().manual_seed(seed), REAL_DTYPE)
    return kw


def measure_real_width(family: str, n_inputs: int) -> dict:
    """measure() on build_real_width(family): counts, error and the seconds it took."""
    t0 = time.time()
    model = build_real_width(family)
    row = run_and_count(model, [real_width_inputs(family, model, s) for s in range(n_inputs)])
    row.update(
        checkpoint=REAL_WIDTH[family][0], seconds=time.time() - t0, params=sum(p.numel() for p in model.parameters())
    )
    return row


def measure(name: str, n_inputs: int) -> dict:
    """One zoo model: mean relative error of backend="fp8" (defaults) vs native, and the report counts."""
    entry = zoo.MODELS[name]
    model = zoo.build(name, seed=0)
    row = run_and_count(model, [zoo.make_inputs(name, model, seed=s, variant=1) for s in range(n_inputs)])
    row.update(model=name, **{"class": entry.class_name, "kind": entry.kind})
    return row


def run_and_count(model, inputs: list) -> dict:
    """Native vs backend="fp8" (defaults) on `inputs`: mean relative error and the report counts."""
    with torch.no_grad():
        natives = [zoo.output_tensor(model(**kw)) for kw in inputs]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fp8")
    with torch.no_grad():
        errs = [rel_err(zoo.output_tensor(compiled(**kw)), ref) for kw, ref in zip(inputs, natives)]
    counts = collections.Counter()
    native = collections.Counter()
    seen = set()
    for report in fx_fp8.get_reports(compiled):
        for e in report.entries:
            key = (report.graph_id, e.node, e.module, e.op)
            if key in seen:
                continue
            seen.add(key)
            fp8 = e.action not in ("native", "weight-only")  # weight-only (W8A16) sensitive linears are not FP8
            counts[(e.op, fp8)] += 1
            if not fp8:
                native[(e.op, ("W8A16 " if e.action == "weight-only" else "") + _label(e.reason))] += 1
    return {
        "error": sum(errs) / len(errs),
        "attention": (counts[("attention", True)], counts[("attention", True)] + counts[("attention", False)]),
        "linear": (counts[("linear", True)], counts[("linear", True)] + counts[("linear", False)]),
        "native": native,
    }


_FLAG = re.compile(r"^(sdpa=\d+|self-attn-only|cross-attn|mask|gqa.*)$")


def _notes(name: str) -> str:
    """The zoo's notes on graph breaks and attention that is no SDPA (its flags dropped), or ""."""
    notes = zoo.MODELS[name].notes
    if not re.search(r"graphs=|no SDPA|eagerly", notes):
        return ""
    return "; ".join(part for part in notes.split("; ") if not _FLAG.match(part))


def _native_text(native: collections.Counter) -> str:
    parts = [
        f"{op}: {label} {n}" for (op, label), n in sorted(native.items(), key=lambda kv: (kv[0][0], -kv[1], kv[0][1]))
    ]
    return "; ".join(parts) or "nothing"


def _real_cell(r: dict) -> str:
    """The real-width column: FP8 attention, FP8 linears, error; '-' for a class measured tiny only."""
    real = r.get("real")
    if real is None:
        return "-"
    return (
        f"{real['attention'][0]}/{real['attention'][1]} attn, {real['linear'][0]}/{real['linear'][1]} lin, "
        f"{100 * real['error']:.2f} %"
    )


def _row(r: dict) -> str:
    fam = " (family)" if r["model"] in FAMILIES else ""
    return (
        f"| `{r['class']}` | {r['model']}{fam} | {r['kind']} | {r['attention'][0]}/{r['attention'][1]} | "
        f"{r['linear'][0]}/{r['linear'][1]} | {100 * r['error']:.2f} % | {_real_cell(r)} | "
        f"{_native_text(r['native'])} |"
    )


HEADER = (
    "| diffusers class | zoo name | kind | FP8 attention (tiny) | FP8 linears (tiny) | "
    "rel. error vs native (tiny) | real width: FP8 attention, FP8 linears, rel. error | not FP8 at tiny width (op, reason, count) |\n"
    "|---|---|---|---|---|---|---|---|"
)


def _real_row(r: dict) -> str:
    real = r["real"]
    cfg = REAL_WIDTH[r["model"]][1]
    width = cfg.get("dim") or cfg["num_attention_heads"] * cfg["attention_head_dim"]
    return (
        f"| {r['model']} | {real['checkpoint']} | {width} | {real['params'] / 1e6:.0f} M | "
        f"{real['attention'][0]}/{real['attention'][1]} | {real['linear'][0]}/{real['linear'][1]} | "
        f"{100 * real['error']:.2f} % | {_native_text(real['native'])} | {real['seconds']:.0f} s |"
    )


REAL_HEADER = (
    "| family | widths of | hidden size | parameters built | FP8 attention | FP8 linears | rel. error vs "
    "native | not FP8 (op, reason, count) | seconds |\n|---|---|---|---|---|---|---|---|---|"
)


def _only_sensitive(rows: list[dict]) -> bool:
    """Measured at real width, and every linear out of FP8 there is a weight-only sensitive one."""
    real = [r["real"] for r in rows if r.get("real") is not None]
    return bool(real) and all(label.startswith("W8A16") for x in real for (op, label) in x["native"] if op == "linear")


INTRO_START = "Every diffusers transformer class of the zoo"


def _intro(n: int, kinds: collections.Counter, worst: dict) -> str:
    return (
        f"{INTRO_START} (`fx_fp8/tools/model_zoo/`): {n} classes "
        f"({kinds['image']} image, {kinds['video']} video, {kinds['audio']} audio). Each is a tiny "
        "random-weight model (hidden size 16-64, the five families 64-96; 1-2 layers, seed 0) run natively "
        "and under `torch.compile(model, backend=\"fp8\")` with no options (the defaults: FP8 attention, FP8 linears, "
        "sensitive linears weight-only) on CPU with the reference lowering, which computes the device kernels' numerics. "
        "\"rel. error\" is the relative L2 error of the output against native, the mean over "
        f"the input seeds. Largest: {100 * worst['error']:.2f} % ({worst['model']})."
    )


NOT_IN_ZOO_TITLE = "Diffusers transformer classes not in the zoo, and why:"


def _not_in_zoo() -> list[str]:
    return [NOT_IN_ZOO_TITLE, "", *[f"- `{c}`: {why}" for c, why in sorted(zoo.NOT_IN_ZOO.items())], ""]


NOTES_TITLE = (
    "Where a model's work is partly outside the graphs (from the zoo's notes; layers Dynamo runs "
    "eagerly between graph pieces are neither quantized nor reported):"
)


def _notes_list(names: list[str]) -> list[str]:
    return [NOTES_TITLE, "", *[f"- {n}: {_notes(n)}" for n in names if _notes(n)], ""]


def page(rows: list[dict], meta: str, command: str, real_inputs: int = 1) -> str:
    worst = max(rows, key=lambda r: r["error"])
    real_rows = [r for r in rows if r.get("real") is not None]
    only_sensitive = _only_sensitive(real_rows)
    kinds = collections.Counter(r["kind"] for r in rows)
    lines = [
        "# Supported models",
        "",
        "<!-- generated by benchmarks/supported_models.py: edit the script, not this file -->",
        "",
        _intro(len(rows), kinds, worst),
        "",
        "The weights are random, so the error shows that FP8 applies and stays bounded, not the image "
        "quality of a trained checkpoint (on the shipped trained tiny model: [tiny_model.md](tiny_model.md)). "
        "\"FP8 attention\" / \"FP8 linears\" count the nodes the report rewrote to FP8 over all graphs; the last "
        "column counts the others by reason (\"W8A16\": weight-only sensitive linears, the rest native; "
        "`fx-fp8 inspect` gives each row). The five "
        "families marked \"(family)\" also have name patterns, CLI example inputs and tiny pipelines; "
        "any other diffusers transformer goes through the same structural rules.",
        "",
        "How each row was measured: every row at **tiny width** (columns 4-6 and the last): hidden size 16-64 (the "
        "five families 64-96), 1-2 layers, random weights, float32, the input size variant 1. "
        + (
            f"The {len(real_rows)} families' rows also at **real width** (column 7; the table below): the released "
            "checkpoint's hidden size, heads, head dim and feed-forward / text widths, with one block of each kind "
            "instead of tens (Flux: one double- and one single-stream block; Z-Image: one noise-refiner, one "
            "context-refiner and one joint layer), random weights, bfloat16, 64 image tokens and 12-16 text tokens "
            f"(Wan: 2 latent frames of 8x8 tokens), {real_inputs} input seed(s). "
            + (
                "At real width the only linears out of FP8 are the sensitive ones (weight-only W8A16): every other one "
                "is wide enough (`min_features` 32, multiples of 16)"
                if only_sensitive
                else "The table below says which linears stay out of FP8 at real width and why"
            )
            + f". The other {len(rows) - len(real_rows)} classes were measured "
            "at tiny width only (\"-\")."
            if real_rows
            else "No row was measured at real width in this run (`--no-real-width`): column 7 is \"-\" throughout."
        ),
        "",
        f"{meta}",
        "",
        f"Regenerate: `{command}`.",
        "",
        HEADER,
        *[_row(r) for r in rows],
        "",
        *(
            ["Real width (random weights; column 7 above):", "", REAL_HEADER, *[_real_row(r) for r in real_rows], ""]
            if real_rows
            else []
        ),
        "Most zoo models are 16-64 wide: their linears narrower than `min_features` (32) or with "
        "features that are not multiples of 16 stay native at tiny width and would be quantized at real sizes "
        "(the five families' real-width column shows it), so for them the error is attention's alone. A model "
        "with nothing in FP8 (0/…, 0/…) shows that it compiles and runs unchanged.",
        "",
        *_notes_list([r["model"] for r in rows]),
        *_not_in_zoo(),
    ]
    return "\n".join(lines)


def excerpt(rows: list[dict]) -> str:
    fam = [r for r in rows if r["model"] in FAMILIES]
    kinds = collections.Counter(r["kind"] for r in rows)
    worst = max(rows, key=lambda r: r["error"])
    body = [
        "| diffusers class | FP8 attention | FP8 linears | rel. error vs native | real width: FP8 attention, "
        "FP8 linears, rel. error |",
        "|---|---|---|---|---|",
    ]
    body += [
        f"| `{r['class']}` | {r['attention'][0]}/{r['attention'][1]} | {r['linear'][0]}/{r['linear'][1]} | "
        f"{100 * r['error']:.2f} % | {_real_cell(r)} |"
        for r in fam
    ]
    return "\n".join(
        [
            START,
            f"{len(rows)} diffusers transformer classes ({kinds['image']} image, {kinds['video']} video, "
            f"{kinds['audio']} audio) compile and run under `backend=\"fp8\"` with default options; tiny "
            f"random-weight versions stay within {100 * worst['error']:.1f} % of native. At widths of 16-64 many "
            "linears are below `min_features` or not multiples of 16 and stay native; the last column measures the "
            "five families at their released checkpoints' widths (one block of each kind, random weights, bfloat16)"
            + (", where every linear but the sensitive ones runs FP8" if _only_sensitive(fam) else "")
            + ". The full table, with what each keeps native and how each row was measured: "
            "[docs/supported_models.md](docs/supported_models.md):",
            "",
            *body,
            END,
        ]
    )


def merge(text: str, rows: list[dict], note: str) -> str:
    """The page `text` (written by page()) with `rows` measured anew: each added or replacing its model's row, the
    others kept as they were measured, in the zoo's order (a model no longer in the zoo loses its row); the counts,
    the largest error, the notes and the not-in-zoo list are recomputed from the zoo and the merged table; `note`
    is appended to the measurement line."""
    lines = text.split("\n")
    head = lines.index(HEADER.split("\n")[0])
    end = lines.index("", head)
    cells = {}  # model -> (line, cells)
    for line in lines[head + 2 : end] + [_row(r) for r in rows]:
        c = [x.strip() for x in line.strip().strip("|").split("|")]
        cells[c[1].removesuffix(" (family)")] = (line, c)
    order = [n for n in zoo.MODELS if n in cells]
    errors = {n: float(cells[n][1][5].removesuffix(" %")) / 100 for n in order}
    worst = max(order, key=errors.get)
    kinds = collections.Counter(cells[n][1][2] for n in order)
    tiny_only = sum(cells[n][1][6] == "-" for n in order)
    out = lines[: head + 2] + [cells[n][0] for n in order] + lines[end:]
    out = [
        _intro(len(order), kinds, {"error": errors[worst], "model": worst})
        if x.startswith(INTRO_START)
        else f"{x} {note}"
        if x.startswith("Measured ")
        else re.sub(r"The other \d+ classes", f"The other {tiny_only} classes", x)
        for x in out
    ]
    out = out[: out.index(NOTES_TITLE)] + _notes_list(order) + _not_in_zoo()
    return "\n".join(out)


def merge_readme_block(text: str, page_text: str) -> str:
    """The README's supported-models sentence with the counts and largest error of the merged page."""
    intro = next(x for x in page_text.split("\n") if x.startswith(INTRO_START))
    counts = re.search(r"(\d+) classes \((\d+ image, \d+ video, \d+ audio)\)", intro)
    worst = float(re.search(r"Largest: ([\d.]+) %", intro)[1])
    i, j = text.find(START), text.find(END)
    block = re.sub(
        r"^\d+ diffusers transformer classes \([^)]*\)",
        f"{counts[1]} diffusers transformer classes ({counts[2]})",
        text[i + len(START) + 1 : j],
        count=1,
    )
    block = re.sub(r"within [\d.]+ % of native", f"within {worst:.1f} % of native", block, count=1)
    return text[: i + len(START) + 1] + block + text[j:]


def replace_block(path: str, block: str) -> None:
    with open(path) as f:
        text = f.read()
    i, j = text.find(START), text.find(END)
    if i < 0 or j < i:
        raise SystemExit(f"{path}: no {START} ... {END} block")
    with open(path, "w") as f:
        f.write(text[:i] + block + text[j + len(END) :])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(zoo.MODELS), choices=list(zoo.MODELS))
    p.add_argument("--inputs", type=int, default=2, help="input seeds per model (the error is their mean)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on small shared machines)")
    p.add_argument("--out", help="write the markdown page here (e.g. docs/supported_models.md)")
    p.add_argument("--readme", help="rewrite the supported-models block of this file (e.g. README.md)")
    p.add_argument(
        "--no-real-width",
        dest="real_width",
        action="store_false",
        help="skip the five families at real width (about 1-3 min each on a 2-core CPU, 3-4 GB)",
    )
    p.add_argument("--real-width-inputs", type=int, default=1, help="input seeds per real-width family")
    p.add_argument(
        "--merge",
        action="store_true",
        help="measure only --models and merge their rows into the --out page (which must exist) and the "
        "--readme counts; the other rows stay as they were measured",
    )
    args = p.parse_args(argv)
    if args.merge and (not args.out or not os.path.isfile(args.out)):
        raise SystemExit(f"--merge needs --out naming an existing page, got {args.out!r}")  # before measuring
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("fx_fp8").setLevel(logging.ERROR)
    start = time.time()
    rows = []
    for name in args.models:
        t = time.time()
        rows.append(measure(name, args.inputs))
        print(f"{name}: {100 * rows[-1]['error']:.2f} % ({time.time() - t:.1f} s)", file=sys.stderr)
        if args.real_width and name in REAL_WIDTH:
            rows[-1]["real"] = measure_real_width(name, args.real_width_inputs)
            real = rows[-1]["real"]
            print(
                f"{name} at real width ({real['checkpoint']}): {100 * real['error']:.2f} % ({real['seconds']:.1f} s)",
                file=sys.stderr,
            )
    import diffusers

    meta = (
        f"Measured {datetime.date.today().isoformat()}: {platform.machine()} CPU, {args.threads} torch "
        f"thread(s); torch {torch.__version__}, diffusers {diffusers.__version__}; {args.inputs} input "
        f"seed(s) per model; {time.time() - start:.0f} s in all."
    )
    command = "python benchmarks/supported_models.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.merge:
        with open(args.out) as f:
            text = merge(
                f.read(),
                rows,
                f"Rows of {', '.join(args.models)} measured "
                f"{datetime.date.today().isoformat()} the same way ({args.inputs} input seed(s), "
                f"{time.time() - start:.0f} s) and merged: `{command.strip()}`.",
            )
        with open(args.out, "w") as f:
            f.write(text)
        if args.readme:
            with open(args.readme) as f:
                readme = merge_readme_block(f.read(), text)
            with open(args.readme, "w") as f:
                f.write(readme)
        print(f"merged {len(rows)} row(s) into {args.out}", file=sys.stderr)
        return 0
    text = page(rows, meta, command.strip(), args.real_width_inputs)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(text)
    if args.readme:
        replace_block(args.readme, excerpt(rows))
        print(f"rewrote the supported-models block of {args.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
