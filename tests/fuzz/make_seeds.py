#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz harnesses (tests/fuzz/corpus/<harness>/): small, valid
examples of each parser's input (and a few near misses), so that libFuzzer starts from inputs that
reach deep into the parsers. Run from the repository root after building dflash (the token cache
and trainer state seeds are written by dflash itself):

    python3 tests/fuzz/make_seeds.py --dflash build/dflash

Only the Python standard library and the xz/zstd command-line tools are used.
"""
import argparse
import json
import lzma
import os
import shutil
import struct
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "tests", "fuzz", "corpus")
TINY = os.path.join(ROOT, "assets", "tiny-qwen3")


def put(harness, name, data):
    d = os.path.join(CORPUS, harness)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def safetensors_bytes(tensors, metadata=None, pad=True):
    """tensors: list of (name, dtype, shape, raw bytes), laid out in order."""
    header, blobs, off = {}, [], 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":"))
    if pad:
        text += " " * ((8 - (len(text) + 8) % 8) % 8)
    return struct.pack("<Q", len(text)) + text.encode() + b"".join(blobs)


def f32(*xs):
    return struct.pack("<%df" % len(xs), *xs)


def seeds_safetensors():
    put("safetensors", "two_tensors", safetensors_bytes(
        [("w", "F32", [2, 2], f32(1, 2, 3, 4)), ("b", "BF16", [3], b"\x80\x3f" * 3)],
        {"format": "pt"}))
    put("safetensors", "all_dtypes", safetensors_bytes(
        [("i64", "I64", [1], struct.pack("<q", -5)), ("i32", "I32", [2], struct.pack("<2i", 1, 2)),
         ("f16", "F16", [2], b"\x00\x3c\x00\xc0"), ("flag", "BOOL", [2], b"\x01\x00"),
         ("empty", "F32", [0, 4], b"")]))
    put("safetensors", "empty_header", safetensors_bytes([]))
    put("safetensors", "unaligned", safetensors_bytes(
        [("a", "BF16", [1], b"\x80\x3f"), ("b", "F32", [1], f32(2.0))], pad=False))


def seeds_index():
    put("safetensors_index", "two_shards", json.dumps(
        {"metadata": {"total_size": 24},
         "weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}}))
    put("safetensors_index", "missing_tensor", json.dumps(
        {"weight_map": {"x": "a.safetensors", "y": "a.safetensors"}}))
    with open(os.path.join(TINY, "model.safetensors.index.json")) as f:
        tiny = json.load(f)
    small = {"metadata": tiny["metadata"], "weight_map": dict(list(tiny["weight_map"].items())[:4])}
    put("safetensors_index", "tiny_subset", json.dumps(small))


def seeds_config():
    with open(os.path.join(TINY, "config.json")) as f:
        put("model_config", "tiny_qwen3", f.read())
    for name in ("qwen2-bias", "llama3-rope", "llama-yarn"):
        with open(os.path.join(ROOT, "tests", "fixtures", "models", name, "config.json")) as f:
            put("model_config", name, f.read())
    with open(os.path.join(TINY, "generation_config.json")) as f:
        put("model_config", "generation_config", f.read())
    drafter = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
        "layer_types": ["full_attention", "full_attention"], "use_sliding_window": False,
        "block_size": 16, "num_target_layers": 6,
        "dflash_config": {"mask_token_id": 299, "target_layer_ids": [1, 3]}}
    put("model_config", "drafter", json.dumps(drafter, indent=1))
    top = dict(drafter)
    del top["dflash_config"]
    del top["model_type"]
    top.update({"mask_token_id": 299, "target_layer_ids": [2]})
    put("model_config", "drafter_top_level", json.dumps(top))


def mini_tokenizer():
    """tiny-qwen3's tokenizer.json cut to its first 400 ids (bytes and the first merges)."""
    with open(os.path.join(TINY, "tokenizer.json")) as f:
        j = json.load(f)
    keep = 400
    vocab = {t: i for t, i in j["model"]["vocab"].items() if i < keep}
    merges = [m for m in j["model"]["merges"]
              if m[0] in vocab and m[1] in vocab and (m[0] + m[1]) in vocab]
    j["model"]["vocab"] = vocab
    j["model"]["merges"] = merges
    return j


def seeds_tokenizer():
    j = mini_tokenizer()
    put("tokenizer_load", "mini_bpe", json.dumps(j, ensure_ascii=False))
    legacy = json.loads(json.dumps(j))
    legacy["model"]["merges"] = [a + " " + b for a, b in legacy["model"]["merges"]]
    legacy["normalizer"] = None
    put("tokenizer_load", "legacy_merges", json.dumps(legacy, ensure_ascii=False))
    seq = json.loads(json.dumps(j))
    seq["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFC"}]}
    seq["added_tokens"].append({"id": 399, "content": "<think>", "single_word": False,
                                "lstrip": True, "rstrip": False, "normalized": False,
                                "special": False})
    put("tokenizer_load", "sequence_normalizer", json.dumps(seq, ensure_ascii=False))

    texts = [b"\x00Hello, world! 123 don't",
             b"\x01<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n"
             b"</think>\n\n4<|im_end|>\n",
             "\x02caf\u00e9 cafe\u0301 \u4e2d\u6587 \U0001F600 \t\n\n  x".encode(),
             b"\x03bad \xff\xfe utf-8 \xc3 end",
             b"\x02     \r\n\r\n\tA1B2C3 1234567890 ''''",
             "\x01\u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u0939\u093f\u0928\u094d\u0926\u0940 "
             "\u00c5ngstr\u00f6m \ufb01".encode()]
    for i, t in enumerate(texts):
        put("tokenizer_encode", "text%d" % i, t)


def records():
    return [
        {"id": 1, "source": "wordnet", "conversations": [
            {"from": "human", "value": "Define cat."}, {"from": "gpt", "value": "A small feline."}]},
        {"id": "m-2", "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
            {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"}]},
        {"id": 3, "conversations": [{"role": "user", "content": "  caf\u00e9  "},
                                    {"role": "assistant", "content": " \u00e9t\u00e9 \n"}]},
    ]


def seeds_chat_template():
    for i, r in enumerate(records()):
        put("chat_template", "record%d" % i, json.dumps(r, ensure_ascii=False))
    put("chat_template", "prompt", json.dumps(
        {"id": 9, "messages": [{"role": "user", "content": "Hi"}]}))
    with open(os.path.join(TINY, "tokenizer_config.json")) as f:
        put("chat_template", "tokenizer_config", f.read())
    with open(os.path.join(TINY, "chat_template.jinja")) as f:
        jinja = f.read()
    put("chat_template", "jinja", jinja)
    put("chat_template", "template_list", json.dumps(
        {"chat_template": [{"name": "default", "template": jinja},
                           {"name": "tool_use", "template": "x"}]}))


def seeds_jsonl():
    text = "\n".join(json.dumps(r, ensure_ascii=False) for r in records()) + "\n\n"
    put("jsonl", "plain.jsonl", text)
    put("jsonl", "crlf.jsonl", text.replace("\n", "\r\n"))
    put("jsonl", "corpus.jsonl.xz", lzma.compress(text.encode()))
    zst = subprocess.run(["zstd", "-q", "-c"], input=text.encode(), stdout=subprocess.PIPE,
                         check=True).stdout
    put("jsonl", "corpus.jsonl.zst", zst)


RUN_YAML = """model:
  target: {target}
  drafter_layers: 1
  intermediate_size: 64
  mask_token_id: 8000
data:
  train_file: {data}
  template: chatml
  max_length: 64
  token_budget: 64
  rows_per_step: 1
  cache_dir: {cache}
training:
  max_steps: 1
  lr: 1.0e-3
  num_anchors: 2
  block_size: 8
  seed: 3
  log_interval: 1
runtime:
  threads: 1
output_dir: {out}
"""


def seeds_run_config():
    with open(os.path.join(ROOT, "configs", "tiny-reference.yaml")) as f:
        put("run_config", "tiny_reference.yaml", f.read())
    small = RUN_YAML.format(target="assets/tiny-qwen3", data="d.jsonl", cache="c", out="runs/x")
    put("run_config", "small.yaml", small)
    put("run_config", "with_overrides",
        small + "\0training.lr=2e-3\0model.target_layer_ids=[1, 3]\0output_dir=runs/y"
        "\0data.template=qwen3")
    put("run_config", "flow.yaml",
        "{model: {target: t, head_dim: 32}, data: {train_file: f}, output_dir: o}\n")


def seeds_from_dflash(dflash):
    """A token cache and a trainer state written by dflash on three records."""
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "d.jsonl")
        with open(data, "w") as f:
            for r in records():
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        cache = os.path.join(tmp, "c.dftok")
        subprocess.run([dflash, "--log-level", "off", "data", "prepare", "--model", TINY,
                        "--data", data, "--template", "chatml", "--max-length", "64",
                        "--token-budget", "64", "--cache", cache], check=True,
                       stdout=subprocess.DEVNULL)
        with open(cache, "rb") as f:
            put("token_cache", "three_docs.dftok", f.read())
        cfg = os.path.join(tmp, "run.yaml")
        with open(cfg, "w") as f:
            f.write(RUN_YAML.format(target=TINY, data=data, cache=os.path.join(tmp, "cache"),
                                    out=os.path.join(tmp, "run")))
        subprocess.run([dflash, "--log-level", "off", "train", "--config", cfg], check=True,
                       stdout=subprocess.DEVNULL)
        with open(os.path.join(tmp, "run", "checkpoint-1", "trainer_state", "state.json")) as f:
            state = f.read()
        put("trainer_state", "step1.json", state)
        j = json.loads(state)
        j["step"], j["skipped"], j["consecutive_skips"] = 7, 2, 1
        put("trainer_state", "skips.json", json.dumps(j))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dflash", required=True, help="the built dflash binary")
    args = ap.parse_args()
    if os.path.isdir(CORPUS):
        shutil.rmtree(CORPUS)
    seeds_safetensors()
    seeds_index()
    seeds_config()
    seeds_tokenizer()
    seeds_chat_template()
    seeds_jsonl()
    seeds_run_config()
    seeds_from_dflash(os.path.abspath(args.dflash))
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(CORPUS) for f in fs)
    print("wrote %s (%d bytes)" % (CORPUS, total))


if __name__ == "__main__":
    main()
