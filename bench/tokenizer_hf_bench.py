"""HF `tokenizers` (and, if importable, the `bpe-qwen` package) on the same corpus strings as
bench/tokenizer_bench.cpp: every conversation of train.jsonl.xz rendered as ChatML
("<|im_start|>{role}\\n{content}<|im_end|>\\n" per turn), encoded without added special tokens.
Reports MB/s of UTF-8 input and tokens/s, best of --runs, with 1 thread (RAYON_NUM_THREADS=1 in a
child process; bpe-qwen: encode() per document) and with all cores (encode_batch /
encode_batch_parallel). Use a venv that has `tokenizers` (and optionally `bpe-qwen`, e.g. a
throwaway one in /tmp: `python3 -m venv /tmp/v && /tmp/v/bin/pip install tokenizers bpe-qwen`):
    python bench/tokenizer_hf_bench.py [--model tokenizer.json(.xz)] [--corpus train.jsonl.xz]
"""
import argparse
import json
import lzma
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def load_docs(corpus):
    docs = []
    with lzma.open(corpus, "rt", encoding="utf-8") as f:
        for line in f:
            j = json.loads(line)
            docs.append("".join(f"<|im_start|>{t['role']}\n{t['content']}<|im_end|>\n"
                                for t in j["conversations"]))
    return docs


def tokenizer_file(model, tmp):
    if model.endswith(".xz"):
        p = os.path.join(tmp, "tokenizer.json")
        with lzma.open(model) as f, open(p, "wb") as g:
            g.write(f.read())
        return p
    return os.path.join(model, "tokenizer.json") if os.path.isdir(model) else model


def bench(name, encode_all, docs, runs, nbytes, threads):
    best, ntok = 1e30, 0
    for _ in range(runs):
        t0 = time.perf_counter()
        ntok = encode_all(docs)
        best = min(best, time.perf_counter() - t0)
    print(f"{name:7s} threads {threads:2d}: {nbytes / 1e6 / best:8.2f} MB/s  {ntok / best:10.0f} "
          f"tokens/s  ({ntok} tokens, best of {runs}: {best:.3f} s)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(
        HERE, "../../shared/fixtures/qwen3-tokenizer/tokenizer.json.xz"))
    ap.add_argument("--corpus", default=os.path.join(HERE, "../../shared/data/train.jsonl.xz"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--child-single", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    docs = load_docs(a.corpus)
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    from tokenizers import Tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        path = tokenizer_file(a.model, tmp)
        tok = Tokenizer.from_file(path)
        hf_all = lambda ds: sum(len(e.ids) for e in tok.encode_batch(ds, add_special_tokens=False))
        bq = load_bpe_qwen(path, tmp)
        if a.child_single:
            bench("hf", hf_all, docs, a.runs, nbytes, 1)
            if bq:
                bench("bpe-qwen", lambda ds: sum(len(bq.encode(d)) for d in ds), docs, a.runs,
                      nbytes, 1)
            return
        print(f"corpus {a.corpus}: {len(docs)} documents, {nbytes / 1e6:.2f} MB; tokenizers "
              f"{__import__('tokenizers').__version__}; bpe-qwen "
              f"{'found' if bq else 'not installed (skipped)'}", flush=True)
        env = dict(os.environ, RAYON_NUM_THREADS="1", RAYON_RS_NUM_CPUS="1")
        subprocess.run([sys.executable, __file__, "--model", a.model, "--corpus", a.corpus,
                        "--runs", str(a.runs), "--child-single"], env=env, check=True)
        bench("hf", hf_all, docs, a.runs, nbytes, os.cpu_count())
        if bq:
            bench("bpe-qwen", lambda ds: sum(len(x) for x in bq.encode_batch_parallel(ds)), docs,
                  a.runs, nbytes, os.cpu_count())


def load_bpe_qwen(tokenizer_json, tmp):
    """The `bpe-qwen` PyPI package's QwenTokenizer, or None. Its package __init__ imports
    transformers, so the compiled module is loaded directly; it reads vocab.json + merges.txt,
    which are written from tokenizer.json into `tmp`."""
    import importlib.machinery
    import importlib.util
    spec = importlib.util.find_spec("bpe_qwen")
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = spec.submodule_search_locations[0]
    so = [f for f in os.listdir(pkg) if f.startswith("bpe_qwen.") and f.endswith(".so")]
    if not so:
        return None
    loader = importlib.machinery.ExtensionFileLoader("bpe_qwen", os.path.join(pkg, so[0]))
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("bpe_qwen", loader))
    loader.exec_module(mod)
    j = json.load(open(tokenizer_json, encoding="utf-8"))
    d = os.path.join(tmp, "bpe-qwen")
    os.makedirs(d, exist_ok=True)
    json.dump(j["model"]["vocab"], open(os.path.join(d, "vocab.json"), "w", encoding="utf-8"),
              ensure_ascii=False)
    with open(os.path.join(d, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for m in j["model"]["merges"]:
            f.write((m if isinstance(m, str) else f"{m[0]} {m[1]}") + "\n")
    return mod.QwenTokenizer(d)


if __name__ == "__main__":
    main()
