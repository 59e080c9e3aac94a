"""Golden test of the tokenizer against fixtures made with HF libraries.

1. The real Qwen3 tokenizer (tokenizer.json.xz, decompressed into a temp dir) must give exactly the
   ids of HF `tokenizers` 0.23 recorded in qwen3-tokenizer/cases.jsonl: 160/160, and decode them
   back to the recorded `decoded` strings.
2. The tiny model's tokenizer (assets/tiny-qwen3) must reproduce every `p{i}.input_ids` tensor of
   tiny-qwen3.golden.safetensors from the prompts in tiny-qwen3.golden.json, and decoding the
   recorded greedy tokens up to <|im_end|> must give the recorded `greedy_text`.

Everything goes through `dflash tokenize` (one process per batch, records through stdin).
Exit code 0 = pass; failures print the first differing case.
"""
import argparse
import json
import lzma
import os
import subprocess
import sys
import tempfile

from safetensors.numpy import load_file


def run_dflash(dflash, args, lines):
    inp = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode("utf-8")
    r = subprocess.run([dflash, "tokenize", *args], input=inp, capture_output=True)
    if r.returncode != 0:
        sys.exit(f"FAIL: dflash tokenize {' '.join(args)} exited {r.returncode}: "
                 f"{r.stderr.decode(errors='replace')}")
    out = [json.loads(l) for l in r.stdout.decode("utf-8").split("\n")[:-1]]
    if len(out) != len(lines):
        sys.exit(f"FAIL: {len(lines)} inputs but {len(out)} outputs")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dflash", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--shared", required=True)
    a = ap.parse_args()
    failures = 0

    # 1. Real Qwen3 tokenizer, recorded cases.
    fx = os.path.join(a.shared, "fixtures", "qwen3-tokenizer")
    cases = [json.loads(l) for l in open(os.path.join(fx, "cases.jsonl"), encoding="utf-8")]
    with tempfile.TemporaryDirectory() as tmp:
        with lzma.open(os.path.join(fx, "tokenizer.json.xz")) as f, \
                open(os.path.join(tmp, "tokenizer.json"), "wb") as g:
            g.write(f.read())
        enc = run_dflash(a.dflash, ["--model", tmp, "--jsonl"], [{"text": c["text"]} for c in cases])
        dec = run_dflash(a.dflash, ["--model", tmp, "--jsonl", "--decode"],
                         [{"ids": c["ids"]} for c in cases])
    ok = 0
    for c, e, d in zip(cases, enc, dec):
        if e["ids"] != c["ids"]:
            if failures == 0:
                print(f"first differing case: {c['text']!r}\n  HF:  {c['ids']}\n  ours: {e['ids']}")
            failures += 1
        elif d["text"] != c["decoded"]:
            if failures == 0:
                print(f"decode differs for {c['ids']}: HF {c['decoded']!r} ours {d['text']!r}")
            failures += 1
        else:
            ok += 1
    print(f"qwen3 cases.jsonl: {ok}/{len(cases)} exact (ids and decode)")

    # 2. Tiny model: golden input ids and greedy text.
    golden = json.load(open(os.path.join(a.shared, "fixtures", "tiny-qwen3.golden.json")))
    tensors = load_file(os.path.join(a.shared, "fixtures", "tiny-qwen3.golden.safetensors"))
    model = os.path.join(a.source, "assets", "tiny-qwen3")
    prompts = golden["prompts"]
    enc = run_dflash(a.dflash, ["--model", model, "--jsonl"], [{"text": p["prompt"]} for p in prompts])
    greedy = []
    for p in prompts:
        g = [int(x) for x in tensors[f"p{p['i']}.greedy"].reshape(-1)]
        if 2 in g:  # <|im_end|>
            g = g[: g.index(2) + 1]
        greedy.append({"ids": g})
    dec = run_dflash(a.dflash, ["--model", model, "--jsonl", "--decode"], greedy)
    ok = 0
    for p, e, d in zip(prompts, enc, dec):
        want = [int(x) for x in tensors[f"p{p['i']}.input_ids"].reshape(-1)]
        if e["ids"] != want:
            print(f"tiny prompt {p['i']}: ids differ\n  HF:  {want}\n  ours: {e['ids']}")
            failures += 1
        elif d["text"] != p["greedy_text"]:
            print(f"tiny prompt {p['i']}: greedy decode {d['text']!r} != {p['greedy_text']!r}")
            failures += 1
        else:
            ok += 1
    print(f"tiny-qwen3 golden: {ok}/{len(prompts)} prompts (input_ids and greedy decode)")
    if failures:
        sys.exit(f"FAIL: {failures} mismatches")
    print("PASS")


if __name__ == "__main__":
    main()
