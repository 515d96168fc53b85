#!/usr/bin/env python3
"""Run the lazytensor benchmarks and report lazytensor/peer ratios (stdlib only).

    scripts/bench_report.py [BUILD_DIR] [--no-run] [-- extra benchmark flags...]

BUILD_DIR defaults to $BUILD_DIR, else "build". Every executable bench_* in
BUILD_DIR/benchmarks is run with

    --benchmark_format=json --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
    --benchmark_enable_random_interleaving=true

and the medians are used. The raw JSON is kept next to each executable (<exe>.json);
--no-run re-reads those files instead of running again.

Output: a markdown report on stdout and in benchmarks/results.md: one table per benchmark
family with each peer's throughput and the ratio lazytensor/peer (a throughput ratio: > 1
means lazytensor is faster), then the performance targets. When gnuplot is on PATH, also
benchmarks/results.png (throughput in GB/s against N, log2 x axis).

Naming convention (see benchmarks/bench_common.hpp): BM_<Family>_<Variant>/<args>. The
variant "Lazy" is lazytensor, variants ending in "Threads" are thread-scaling runs with the
thread count as last argument, every other variant is a peer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_MD = ROOT / "benchmarks" / "results.md"
OUT_PNG = ROOT / "benchmarks" / "results.png"
FLAGS = [
    "--benchmark_format=json",
    "--benchmark_repetitions=5",
    "--benchmark_report_aggregates_only=true",
    # Repetitions of all the benchmarks of a program run in random order, so a burst of
    # machine noise lands on lazytensor and its peers alike instead of on one of them.
    "--benchmark_enable_random_interleaving=true",
]
LAZY = "Lazy"

# Families in report order: title, what the size argument means, the throughput unit.
FAMILIES = {
    "Chain": ("Element-wise chain y = relu(a*b + c) * d - 0.5*a", "N", "GB/s"),
    "Reduce": ("Reduction sum((a - b)^2)", "N", "GB/s"),
    "Linear": ("relu(linear(x, w, b)), 784 -> 256", "batch", "GFLOP/s"),
    "MarkStep": ("mark_step overhead (16-element tensors)", "N", "us"),
}
# Column order of the variants (others follow in name order); LazyUnfused is lazytensor
# itself with fusion defeated, shown for reference.
VARIANT_ORDER = ["Lazy", "EigenEagerFresh", "EigenEagerPrealloc", "EigenExpr", "Eigen", "EigenSeq", "Xtensor",
                 "Torch", "LazyUnfused", "Chain100", "Chain100StepOnly", "Chain100Eigen", "Empty"]


def variant_key(v: str):
    return (VARIANT_ORDER.index(v) if v in VARIANT_ORDER else len(VARIANT_ORDER), v)

TIME_SCALE = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


# ---- running and parsing ------------------------------------------------------------------

def find_executables(build: Path) -> list[Path]:
    d = build / "benchmarks"
    if not d.is_dir():
        sys.exit(f"error: {d} does not exist; build with -DLAZYTENSOR_BUILD_BENCHMARKS=ON first")
    exes = sorted(p for p in d.iterdir()
                  if p.name.startswith("bench_") and p.is_file() and os.access(p, os.X_OK)
                  and p.suffix == "")
    if not exes:
        sys.exit(f"error: no bench_* executables in {d}; build the 'benchmarks' target first")
    return exes


def run_one(exe: Path, extra: list[str], rerun: bool) -> dict:
    out = exe.with_name(exe.name + ".json")
    if rerun:
        print(f"running {exe.name} ...", file=sys.stderr, flush=True)
        res = subprocess.run([str(exe), *FLAGS, f"--benchmark_out={out}", "--benchmark_out_format=json", *extra],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if res.returncode != 0:
            sys.stderr.write(res.stderr)
            sys.exit(f"error: {exe.name} exited with status {res.returncode}")
    elif not out.exists():
        sys.exit(f"error: --no-run but {out} does not exist")
    return json.loads(out.read_text())


class Result:
    """The median of one benchmark (name without the /real_time or /manual_time suffix)."""

    def __init__(self, b: dict):
        name = re.sub(r"/(real_time|manual_time)$", "", b["run_name"])
        self.name = name
        head, *args = name.split("/")
        m = re.match(r"BM_([A-Za-z0-9]+)_([A-Za-z0-9]+)$", head)
        self.family, self.variant = (m.group(1), m.group(2)) if m else (head, "")
        self.args = tuple(int(a) if a.lstrip("-").isdigit() else a for a in args)
        self.seconds = b["real_time"] * TIME_SCALE[b.get("time_unit", "ns")]
        self.bytes_per_second = b.get("bytes_per_second")
        self.items_per_second = b.get("items_per_second")
        self.gflops = b.get("GFLOP")
        self.error = b.get("error_message") if b.get("error_occurred") else None

    def throughput(self, unit: str) -> float:
        if unit == "GB/s" and self.bytes_per_second:
            return self.bytes_per_second / 1e9
        if unit == "GFLOP/s" and self.gflops:
            return self.gflops
        return 1.0 / self.seconds


def collect(runs: list[dict]) -> tuple[list[Result], dict]:
    results, context = [], {}
    for run in runs:
        context = context or run.get("context", {})
        for b in run.get("benchmarks", []):
            if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
                continue
            if b.get("error_occurred"):
                results.append(Result(b))
                continue
            if b.get("run_type") == "aggregate":
                results.append(Result(b))
    return results, context


# ---- formatting ----------------------------------------------------------------------------

def fmt_size(v) -> str:
    if isinstance(v, int) and v >= 1024 and v & (v - 1) == 0:
        return f"2^{v.bit_length() - 1}"
    return str(v)


def fmt_num(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def fmt_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{fmt_num(seconds / scale)} {unit}"
    return f"{fmt_num(seconds / 1e-9)} ns"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" ---: " for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def family_table(fam: str, rs: list[Result]) -> str:
    title, argname, unit = FAMILIES.get(fam, (fam, "args", "1/s"))
    by = {(r.variant, r.args): r for r in rs if not r.variant.endswith("Threads")}
    variants = sorted({r.variant for r in rs if not r.variant.endswith("Threads")}, key=variant_key)
    peers = [v for v in variants if v != LAZY]
    sizes = sorted({r.args for r in rs if r.variant in variants}, key=lambda a: a)
    out = [f"### {title}\n"]
    if fam == "MarkStep":
        rows = [[r.name, fmt_time(r.seconds)] for r in sorted(rs, key=lambda r: variant_key(r.variant))]
        return "\n".join(out) + "\n" + table(["benchmark", "median time"], rows) + "\n"
    header = [argname, f"lazytensor {unit}"] + [f"{p} {unit}" for p in peers] + [f"lazy/{p}" for p in peers]
    rows = []
    for a in sizes:
        lz = by.get((LAZY, a))
        row = [fmt_size(a[0]) if a else "-", fmt_num(lz.throughput(unit)) if lz else "-"]
        ratios = []
        for p in peers:
            pr = by.get((p, a))
            row.append(fmt_num(pr.throughput(unit)) if pr else "-")
            ratios.append(f"**{pr.seconds / lz.seconds:.2f}x**" if (pr and lz) else "-")
        rows.append(row + ratios)
    return "\n".join(out) + "\n" + table(header, rows) + "\n"


def find(results: list[Result], family: str, variant: str, *args) -> Result | None:
    for r in results:
        if r.family == family and r.variant == variant and r.args == tuple(args):
            return r
    return None


def targets(results: list[Result]) -> str:
    rows = []

    def ratio_row(what, fam, peer, args, goal):
        lz, pr = find(results, fam, LAZY, *args), find(results, fam, peer, *args)
        if not (lz and pr):
            rows.append([what, "not measured", f">= {goal}x", "?"])
            return
        ratio = pr.seconds / lz.seconds
        rows.append([what, f"{ratio:.2f}x", f">= {goal}x", "PASS" if ratio >= goal else "**MISS**"])

    n24 = 1 << 24
    ratio_row("chain 2^24 vs eager Eigen (preallocated)", "Chain", "EigenEagerPrealloc", (n24,), 3.0)
    ratio_row("chain 2^24 vs Eigen single expression", "Chain", "EigenExpr", (n24,), 0.9)
    sizes = sorted({r.args for r in results if r.family == "Reduce" and r.variant == LAZY})
    for a in sizes:
        ratio_row(f"reduction {fmt_size(a[0])} vs Eigen", "Reduce", "Eigen", a, 0.9)
    ratio_row("fused linear+relu (batch 256) vs Eigen GEMM + bias + relu", "Linear", "EigenSeq", (256,), 1.0)

    for name, label in (("Chain100", "mark_step: build + run 100 tiny nodes"),
                        ("Chain100StepOnly", "mark_step: run 100 tiny nodes (graph prebuilt)"),
                        ("Chain100Eigen", "peer: same 100 statements, eager Eigen")):
        r = next((x for x in results if x.family == "MarkStep" and x.variant == name), None)
        if r:
            rows.append([label, f"{r.seconds * 1e6:.1f} us ({r.seconds * 1e6 / 100:.2f} us/node)", "info", ""])
    r = find(results, "MarkStep", "Empty")
    if r:
        rows.append(["empty mark_step", f"{r.seconds * 1e6:.3f} us", "info", ""])

    for fam, label, args in (("Chain", "chain 2^24", (n24,)), ("Reduce", "reduction 2^24", (n24,)),
                             ("Linear", "linear batch 256", (256,))):
        one, two = find(results, fam, "LazyThreads", *args, 1), find(results, fam, "LazyThreads", *args, 2)
        if one and two:
            rows.append([f"{label}: 2 threads / 1 thread", f"{one.seconds / two.seconds:.2f}x", "info", ""])
    return "### Targets\n\n" + table(["target", "measured", "goal", "status"], rows) + "\n"


def plot(results: list[Result]) -> bool:
    gnuplot = shutil.which("gnuplot")
    if not gnuplot:
        return False
    panels = []
    with tempfile.TemporaryDirectory() as tmp:
        for fam in ("Chain", "Reduce"):
            rs = [r for r in results if r.family == fam and not r.variant.endswith("Threads") and r.args]
            variants = sorted({r.variant for r in rs}, key=variant_key)
            if not variants:
                continue
            files = []
            for v in variants:
                f = Path(tmp) / f"{fam}_{v}.dat"
                pts = sorted((r.args[0], r.throughput("GB/s")) for r in rs if r.variant == v)
                f.write_text("".join(f"{n} {gbs}\n" for n, gbs in pts))
                title = "lazytensor" if v == LAZY else v
                files.append(f"'{f}' using 1:2 with linespoints lw 2 title '{title}'")
            panels.append((FAMILIES[fam][0], files))
        if not panels:
            return False
        terms = subprocess.run([gnuplot, "-e", "set terminal"], capture_output=True, text=True)
        term = "pngcairo" if re.search(r"^\s*pngcairo\s", terms.stdout + terms.stderr, re.M) else "png"
        script = [
            f"set terminal {term} noenhanced size 1000,{420 * len(panels)}",
            f"set output '{OUT_PNG}'",
            f"set multiplot layout {len(panels)},1",
            "set logscale x 2", "set format x '2^{%L}'", "set xlabel 'N (elements)'",
            "set ylabel 'throughput (GB/s)'", "set grid", "set key outside right",
        ]
        for title, files in panels:
            script += [f"set title \"{title}\"", "plot " + ", ".join(files)]
        script.append("unset multiplot")
        res = subprocess.run([gnuplot], input="\n".join(script), text=True, capture_output=True)
        if res.returncode != 0:
            sys.stderr.write("gnuplot failed:\n" + res.stderr)
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build_dir", nargs="?", default=os.environ.get("BUILD_DIR", "build"))
    ap.add_argument("--no-run", action="store_true", help="re-read the JSON of a previous run")
    ap.add_argument("extra", nargs="*", help="extra flags for every benchmark program (after --)")
    args = ap.parse_args()
    build = Path(args.build_dir)
    if not build.is_absolute():
        build = Path.cwd() / build

    runs = [run_one(exe, args.extra, not args.no_run) for exe in find_executables(build)]
    results, ctx = collect(runs)

    errors = [r for r in results if r.error]
    results = [r for r in results if not r.error]
    fams = [f for f in FAMILIES if any(r.family == f for r in results)]
    fams += sorted({r.family for r in results} - set(fams))

    caches = ", ".join(f"L{c['level']} {c['size'] // 1024} KiB" for c in ctx.get("caches", [])
                       if c.get("type") in ("Data", "Unified"))
    loads = sorted({tuple(round(x, 1) for x in r.get("context", {}).get("load_avg", [])) for r in runs})
    md = [
        "# lazytensor benchmark results",
        "",
        f"{datetime.date.today()} on {ctx.get('host_name', '?')}: {ctx.get('num_cpus', '?')} CPUs at "
        f"{ctx.get('mhz_per_cpu', '?')} MHz" + (f" ({caches})" if caches else "") + "; load average at the "
        f"start of each program: {', '.join('/'.join(map(str, l)) for l in loads) or '?'}.",
        "",
        "Medians of 5 repetitions, wall-clock time. Ratios are lazytensor/peer throughput "
        "(> 1: lazytensor is faster). All peers are single-threaded, so lazytensor runs on 1 thread in "
        "the ratio tables; the thread-scaling rows use the LazyThreads benchmarks. lazytensor times "
        "include building the graph and mark_step (and item() for the reduction). LazyUnfused is "
        "lazytensor itself with the GEMM result held, so the epilogue cannot fuse.",
        "",
    ]
    for fam in fams:
        md.append(family_table(fam, [r for r in results if r.family == fam]))
    md.append(targets(results))
    if errors:
        md.append("### Errors\n\n" + "\n".join(f"- {r.name}: {r.error}" for r in errors) + "\n")
    text = "\n".join(md)
    OUT_MD.write_text(text)
    print(text)
    if plot(results):
        print(f"wrote {OUT_MD} and {OUT_PNG}", file=sys.stderr)
    else:
        print(f"wrote {OUT_MD} (no gnuplot: no plot)", file=sys.stderr)


if __name__ == "__main__":
    main()
