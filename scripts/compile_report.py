#!/usr/bin/env python3
"""What a user pays to compile lazytensor, against libtorch and Eigen, in one run.

Builds the same three-line program (a random 64x64 tensor, relu(a * 2 + 1), print the sum)
with each library, plus examples/fashion_mnist/main.cpp, each `--runs` times (default 3),
with `g++ -std=c++20 -O2 -march=native`, compile and link in one command, no ccache. Reports
the median wall time and the median peak memory (GNU time's maximum resident set size) and
the ratios to libtorch, and writes them into the section of benchmarks/results.md between
the compile-report markers (scripts/bench_report.py keeps that section when it rewrites the
file). Peers that are not installed (libtorch: Debian's libtorch-dev) are listed as missing.

  python3 scripts/compile_report.py [--runs N] [--cxx g++] [--no-write] [--baseline DIR]

The `*_compiled` rows build the same programs against the compiled runtime
(lazytensor::compiled: -DLAZYTENSOR_COMPILED, linked with src/compiled*.cpp's objects, which are
built once beforehand and not timed).

--baseline DIR adds the lazytensor rows compiled against another checkout's include/ (an
older revision, `git worktree add DIR <rev>`), interleaved with the others: a before/after
ratio from one run. Its tensor program includes tensor.hpp, ops/random.hpp and
ops/reduction.hpp, which older revisions needed for randn and sum.
"""
import argparse
import datetime
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results.md"
BEGIN = "<!-- compile-report:begin -->"
END = "<!-- compile-report:end -->"

PROGRAM_BODY = """
int main() {{
  {body}
}}
"""

LAZY_BODY = """auto a = lazy::randn<float>({64, 64});
  lazy::Tensor<float> y = lazy::relu(a * 2 + 1);
  std::cout << lazy::sum(y).item() << "\\n";"""

PROGRAMS = {
    "umbrella": ("#include <lazytensor/lazytensor.hpp>\n#include <iostream>\n", LAZY_BODY),
    "tensor": ("#include <lazytensor/tensor.hpp>\n#include <iostream>\n", LAZY_BODY),
    "tensor_baseline": ("#include <lazytensor/tensor.hpp>\n#include <lazytensor/ops/random.hpp>\n"
                        "#include <lazytensor/ops/reduction.hpp>\n#include <iostream>\n", LAZY_BODY),
    "libtorch": ("#include <torch/torch.h>\n#include <iostream>\n",
                 """auto a = torch::randn({64, 64});
  auto y = torch::relu(a * 2 + 1);
  std::cout << y.sum().item<float>() << "\\n";"""),
    "eigen": ("#include <Eigen/Dense>\n#include <iostream>\n",
              """Eigen::MatrixXf a = Eigen::MatrixXf::Random(64, 64);
  Eigen::MatrixXf y = (a.array() * 2 + 1).max(0.f).matrix();
  std::cout << y.sum() << "\\n";"""),
}

LABELS = {
    "umbrella": "lazytensor, `<lazytensor/lazytensor.hpp>` (header-only)",
    "tensor": "lazytensor, `<lazytensor/tensor.hpp>` alone",
    "libtorch": "libtorch, `<torch/torch.h>`",
    "eigen": "Eigen, `<Eigen/Dense>`",
    "fashion_mnist": "`examples/fashion_mnist/main.cpp` (umbrella, header-only)",
    "umbrella_compiled": "lazytensor, `<lazytensor/lazytensor.hpp>` with lazytensor::compiled",
    "tensor_compiled": "lazytensor, `<lazytensor/tensor.hpp>` with lazytensor::compiled",
    "fashion_mnist_compiled": "`examples/fashion_mnist/main.cpp` with lazytensor::compiled",
}
COMPILED = {"umbrella_compiled": "umbrella", "tensor_compiled": "tensor",
            "fashion_mnist_compiled": "fashion_mnist"}


def eigen_include():
    try:
        out = subprocess.run(["pkg-config", "--cflags-only-I", "eigen3"], capture_output=True,
                             text=True, check=True).stdout.split()
        if out:
            return out
    except (OSError, subprocess.CalledProcessError):
        pass
    return ["-I/usr/include/eigen3"]


def command(name, src, exe, cxx, root=ROOT, runtime=None):
    base = [cxx, "-std=c++20", "-O2", "-march=native", "-pthread"]
    if name == "libtorch":
        inc = ["-I/usr/include/torch/csrc/api/include"]
        return base + inc + [str(src), "-o", str(exe), "-ltorch", "-ltorch_cpu", "-lc10"]
    if name == "eigen":
        return base + eigen_include() + [str(src), "-o", str(exe)]
    lazy = ["-I" + str(root / "include")] + eigen_include()
    if runtime:  # the compiled runtime's objects (zlib: its IDX reader)
        return base + lazy + ["-DLAZYTENSOR_COMPILED", str(src)] + [str(r) for r in runtime] + ["-o", str(exe), "-lz"]
    libs = ["-lz"] if name == "fashion_mnist" else []
    return base + lazy + [str(src), "-o", str(exe)] + libs


def available(name):
    if name == "libtorch":
        return pathlib.Path("/usr/include/torch/csrc/api/include/torch/torch.h").exists()
    return True


def measure(cmd, time_bin):
    """Wall seconds and peak KiB of one compile, from GNU time."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        proc = subprocess.run([time_bin, "-f", "%e %M", "-o", tf.name] + cmd,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"compile failed: {' '.join(cmd)}")
        wall, kib = tf.read().split()[-2:]
        return float(wall), int(kib)


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_kind():
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
        return "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "SSE2"
    except (OSError, StopIteration):
        return "unknown ISA"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    ap.add_argument("--no-write", action="store_true", help="print the table, leave results.md alone")
    ap.add_argument("--only", nargs="*", help="a subset of: " + " ".join(LABELS))
    ap.add_argument("--baseline", type=pathlib.Path, help="another checkout to compare the lazytensor rows with")
    args = ap.parse_args()

    time_bin = shutil.which("time") or "/usr/bin/time"
    if not pathlib.Path(time_bin).exists():
        raise SystemExit("GNU time is needed (apt-get install time)")

    names = args.only or list(LABELS)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        sources = {}
        for name in names:
            if COMPILED.get(name, name) == "fashion_mnist":
                sources[name] = ROOT / "examples" / "fashion_mnist" / "main.cpp"
            else:
                head, body = PROGRAMS[COMPILED.get(name, name)]
                src = tmp / f"{name}.cpp"
                src.write_text(head + PROGRAM_BODY.format(body=body))
                sources[name] = src
        runnable = [n for n in names if available(n)]
        jobs = {n: (n, sources[n], ROOT) for n in runnable}
        if args.baseline:
            base = args.baseline.resolve()
            for n in ["umbrella", "tensor", "fashion_mnist"]:
                if n not in names:
                    continue
                src = sources[n]
                if n == "tensor":
                    head, body = PROGRAMS["tensor_baseline"]
                    src = tmp / "tensor_baseline.cpp"
                    src.write_text(head + PROGRAM_BODY.format(body=body))
                elif n == "fashion_mnist":
                    src = base / "examples" / "fashion_mnist" / "main.cpp"
                jobs[n + "@baseline"] = (n, src, base)
                LABELS[n + "@baseline"] = LABELS[n] + " (baseline)"
        runtime = None
        if any(n in COMPILED for n in jobs):
            runtime = []
            print("building the compiled runtime (not timed)", file=sys.stderr)
            for unit in ("compiled", "compiled_frontend", "compiled_nn_wide"):
                obj = tmp / (unit + ".o")
                subprocess.run([args.cxx, "-std=c++20", "-O2", "-march=native", "-pthread", "-c"] +
                               ["-I" + str(ROOT / "include")] + eigen_include() +
                               [str(ROOT / "src" / (unit + ".cpp")), "-o", str(obj)], check=True)
                runtime.append(obj)
        runnable = list(jobs)
        names = names + [j for j in jobs if j.endswith("@baseline")]
        samples = {n: [] for n in runnable}
        # Interleave the programs so the VM's drift spreads over all of them alike.
        for r in range(args.runs):
            for name in runnable:
                kind, src, root = jobs[name]
                cmd = command(COMPILED.get(kind, kind), src, tmp / name.replace("@", "_"), args.cxx, root,
                              runtime if kind in COMPILED else None)
                samples[name].append(measure(cmd, time_bin))
                print(f"run {r + 1}/{args.runs} {name}: {samples[name][-1][0]:.1f} s, "
                      f"{samples[name][-1][1] / 1024:.0f} MiB", file=sys.stderr)
        for name in runnable:
            results[name] = (statistics.median(s[0] for s in samples[name]),
                             statistics.median(s[1] for s in samples[name]))

    torch = results.get("libtorch")
    lines = [BEGIN, "", "### Compile cost of a user's program", "",
             f"{datetime.date.today().isoformat()}, {cpu_name()} ({cpu_kind()}), "
             f"{os.cpu_count()} CPUs; `{args.cxx} -std=c++20 -O2 -march=native`, compile and link in "
             f"one command, no ccache; medians of {args.runs} (`python3 scripts/compile_report.py`). "
             "The three-line program: a random 64x64 tensor, relu(a * 2 + 1), print the sum.", "",
             "| program | wall time | peak memory | time vs libtorch |",
             "| --- | ---: | ---: | ---: |"]
    for name in names:
        if name not in results:
            lines.append(f"| {LABELS[name]} | not installed | | |")
            continue
        wall, kib = results[name]
        ratio = f"{wall / torch[0]:.2f}x" if torch else "n/a"
        lines.append(f"| {LABELS[name]} | {wall:.1f} s | {kib / 1024:.0f} MiB | {ratio} |")
    lines += ["", END]
    section = "\n".join(lines)
    print(section)
    if args.no_write:
        return
    text = RESULTS.read_text() if RESULTS.exists() else "# lazytensor benchmark results\n"
    if BEGIN in text and END in text:
        pre, rest = text.split(BEGIN, 1)
        post = rest.split(END, 1)[1]
        text = pre + section + post
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    RESULTS.write_text(text)
    print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
