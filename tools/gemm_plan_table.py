#!/usr/bin/env python3
"""Writes src/ops/gemm_plan_table_data.cpp from gemm_bench's PLAN lines (ops/gemm_plan_table.hpp).

    python3 tools/gemm_plan_table.py --device "NVIDIA H200 (driver …)" --command "…" \
        --protocol "…" LOG [LOG...] > src/ops/gemm_plan_table_data.cpp

Each LOG is a gemm_bench output (other lines are ignored). A candidate is one algorithm (its eight
words) of one key (sm, cuBLASLt version, M, N, K, leading dimensions, transposes, output dtype,
beta ≠ 0); its time is the median of its `ms` over the logs (each already a median over runs, as
--protocol says: how the gemm_bench version that wrote the logs timed its candidates).
Per key the entry names the fastest candidate, except that the heuristic's first one (cand=0) is
kept unless the fastest beats it by more than MARGIN (3 %): a closer call is within the run-to-run
spread of one shape (docs/perf-runs.md), and the first plan is what runs without the table. A key is
an error when the logs disagree on which algorithm is the heuristic's first.
"""
import argparse
import statistics
import sys
import textwrap

MARGIN = 0.03
KEY_FIELDS = ("sm", "lt", "M", "N", "K", "lda", "ldb", "ldc", "ta", "tb", "out", "acc")
ALGO_FIELDS = ("algo", "tile", "stages", "splitk", "reduction", "swizzle", "custom", "inner",
               "cluster")


def parse_line(line, where):
    head, _, name = line.rstrip("\n").partition(" name=")
    fields = dict(tok.split("=", 1) for tok in head.split()[1:])
    missing = [f for f in KEY_FIELDS + ALGO_FIELDS + ("cand", "ms", "words") if f not in fields]
    if missing or not name:
        sys.exit(f"{where}: PLAN line without {', '.join(missing) or 'name'}")
    words = fields["words"].split(",")
    if len(words) != 8:
        sys.exit(f"{where}: {len(words)} algorithm words, expected 8")
    return name, fields, tuple(words)


def read_logs(paths):
    shapes = {}  # key -> {"name", "first": words, "cands": {words: (fields, [ms])}}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.startswith("PLAN "):
                    continue
                where = f"{path}:{lineno}"
                name, fields, words = parse_line(line, where)
                key = tuple(fields[k] for k in KEY_FIELDS)
                shape = shapes.setdefault(key, {"names": [], "first": None, "cands": {}})
                if name not in shape["names"]:
                    shape["names"].append(name)  # two roles may share a key (o_proj/q_proj dW)
                if fields["cand"] == "0":
                    if shape["first"] not in (None, words):
                        sys.exit(f"{where}: the heuristic's first plan differs between logs")
                    shape["first"] = words
                entry = shape["cands"].setdefault(words, (fields, []))
                entry[1].append(float(fields["ms"]))
    return shapes


def choose(shape, where):
    if shape["first"] is None:
        sys.exit(f"{where}: no cand=0 line (the heuristic's first plan)")
    timed = {w: statistics.median(ms) for w, (_, ms) in shape["cands"].items()}
    first_ms = timed[shape["first"]]
    best = min(timed, key=timed.get)
    if timed[best] > (1.0 - MARGIN) * first_ms:
        best = shape["first"]
    return best, timed[best], first_ms


def cpp_entry(key, shape, words, ms, first_ms):
    k = dict(zip(KEY_FIELDS, key))
    a = shape["cands"][words][0]
    out = "DType::f32" if k["out"] == "f32" else "DType::bf16"
    hexwords = [f"0x{w}ull" for w in words]
    name = " / ".join(shape["names"])
    return (f'    {{"{name}",\n'
            f'     {{{k["sm"]}, {k["lt"]}, {k["M"]}, {k["N"]}, {k["K"]}, {k["lda"]}, {k["ldb"]}, '
            f'{k["ldc"]}, {"true" if k["ta"] == "1" else "false"}, '
            f'{"true" if k["tb"] == "1" else "false"}, {out}, '
            f'{"true" if k["acc"] == "1" else "false"}}},\n'
            f'     {{{a["algo"]}, {a["tile"]}, {a["stages"]}, {a["splitk"]}, {a["reduction"]}, '
            f'{a["swizzle"]}, {a["custom"]}, {a["inner"]}, {a["cluster"]},\n'
            f'      {{{", ".join(hexwords[:4])},\n'
            f'       {", ".join(hexwords[4:])}}}}},\n'
            f'     {ms:.4f}, {first_ms:.4f}}},\n')


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", required=True, help="the device the logs were measured on")
    ap.add_argument("--command", required=True, help="the command that produced the logs")
    ap.add_argument("--protocol", required=True,
                    help="how that gemm_bench timed each candidate (runs, warm-up, order)")
    ap.add_argument("logs", nargs="+")
    args = ap.parse_args()
    shapes = read_logs(args.logs)
    if not shapes:
        sys.exit("no PLAN lines in " + ", ".join(args.logs))
    entries, changed = [], 0
    for key, shape in shapes.items():
        words, ms, first_ms = choose(shape, " / ".join(shape["names"]))
        changed += words != shape["first"]
        entries.append(cpp_entry(key, shape, words, ms, first_ms))
    about = (f"Device: {args.device}. Measured by: {args.command} ({len(args.logs)} log(s); per "
             f"shape the heuristic's first 8 deterministic candidates, {args.protocol}, the "
             f"median over the logs; the fastest kept when it "
             f"beats the heuristic's first by more than {MARGIN * 100:.0f} %, else the first). "
             f"{len(entries)} entries, {changed} of them not the heuristic's first. Per entry: "
             f"name, key {{sm, cuBLASLt version, M, N, K, lda, ldb, ldc, trans_a, trans_b, out, "
             f"accumulate}}, algorithm {{id, tile, stages, split-K, reduction, swizzle, custom, "
             f"inner shape, cluster shape, words}}, the measured ms of the entry's plan and of the "
             f"heuristic's first.")
    header = "\n".join("// " + line for line in textwrap.wrap(about, 97))
    sys.stdout.write(f"""// dflash.cpp — the measured GEMM plan table (ops/gemm_plan_table.hpp). Written by
// tools/gemm_plan_table.py from gemm_bench's PLAN lines; do not edit by hand.
//
{header}
#include <array>

#include "ops/gemm_plan_table.hpp"

namespace dflash {{

namespace {{

// clang-format off
const std::array<GemmPlanEntry, {len(entries)}> kEntries{{{{
""")
    sys.stdout.write("".join(entries))
    sys.stdout.write("""}};
// clang-format on

}  // namespace

std::span<const GemmPlanEntry> gemm_plan_table() {
  static const bool valid = (gemm_plan_table_validate(kEntries), true);
  (void)valid;
  return kEntries;
}

}  // namespace dflash
""")


if __name__ == "__main__":
    main()
