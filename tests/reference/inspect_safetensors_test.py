"""Differential test of dflash's safetensors reader and `dflash inspect` against HF `safetensors`.

The reference library (safetensors 0.8, numpy backend) writes checkpoints; `dflash inspect` must
report the same parameter count and bytes by dtype as the library computes from what it reads back,
for a single-file qwen2 model (biases on q/k/v), a sharded llama model with an untied lm_head and
mixed dtypes (f32/f16/bf16-as-raw), and it must refuse a file the library itself refuses.
Usage: inspect_safetensors_test.py --dflash BIN --source SRC --shared SHARED. Exit 0 = pass.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
from safetensors.numpy import load_file, save_file


def run_inspect(dflash, folder):
    r = subprocess.run([dflash, "inspect", folder], capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def field(out, key):
    m = re.search(r"(?m)^" + re.escape(key) + r": *(.*)$", out)
    return m.group(1) if m else None


def qwen2_tensors(rng, H, I, NH, NKV, D, V, L, dtype):
    t = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    for i in range(L):
        a = f"model.layers.{i}.self_attn."
        t[a + "q_proj.weight"] = (NH * D, H)
        t[a + "k_proj.weight"] = (NKV * D, H)
        t[a + "v_proj.weight"] = (NKV * D, H)
        t[a + "o_proj.weight"] = (H, NH * D)
        t[a + "q_proj.bias"] = (NH * D,)
        t[a + "k_proj.bias"] = (NKV * D,)
        t[a + "v_proj.bias"] = (NKV * D,)
        m = f"model.layers.{i}.mlp."
        t[m + "gate_proj.weight"] = (I, H)
        t[m + "up_proj.weight"] = (I, H)
        t[m + "down_proj.weight"] = (H, I)
        t[f"model.layers.{i}.input_layernorm.weight"] = (H,)
        t[f"model.layers.{i}.post_attention_layernorm.weight"] = (H,)
    return {k: rng.standard_normal(s).astype(dtype) for k, s in t.items()}


def expected(folder):
    """Parameter count and bytes by dtype from what the reference library reads back."""
    files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    n, by = 0, {}
    for f in files:
        for k, a in load_file(os.path.join(folder, f)).items():
            n += a.size
            by[str(a.dtype)] = by.get(str(a.dtype), 0) + a.nbytes
    return n, by, len(files)


def fmt_int(n):
    return f"{n:,}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dflash", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--shared", required=True)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    names = {"float32": "f32", "float16": "f16"}
    failures = []

    def check(cond, what):
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    with tempfile.TemporaryDirectory() as tmp:
        # 1. Single-file qwen2 with q/k/v biases, f32, odd sizes.
        q = os.path.join(tmp, "qwen2")
        os.mkdir(q)
        H, I, NH, NKV, D, V, L = 48, 70, 6, 2, 8, 129, 3
        save_file(qwen2_tensors(rng, H, I, NH, NKV, D, V, L, np.float32),
                  os.path.join(q, "model.safetensors"), metadata={"format": "pt"})
        json.dump({"model_type": "qwen2", "hidden_size": H, "intermediate_size": I,
                   "num_attention_heads": NH, "num_key_value_heads": NKV, "num_hidden_layers": L,
                   "vocab_size": V, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
                   "rope_theta": 10000.0, "tie_word_embeddings": True},
                  open(os.path.join(q, "config.json"), "w"))
        rc, out, err = run_inspect(args.dflash, q)
        check(rc == 0, f"qwen2 single file: inspect exits 0 (stderr: {err.strip()[:300]})")
        n, by, shards = expected(q)
        check(field(out, "parameters") == fmt_int(n), f"qwen2 parameters {field(out, 'parameters')} == {fmt_int(n)}")
        want = ", ".join(f"{names[k]} {fmt_int(v)}" for k, v in sorted(by.items(), key=lambda kv: names[kv[0]]))
        check(field(out, "bytes by dtype") == want, f"qwen2 bytes by dtype '{field(out, 'bytes by dtype')}' == '{want}'")
        check(field(out, "shards") == "1", "qwen2 shards == 1")
        check(field(out, "attention bias") == "q, k, v", "qwen2 attention bias q, k, v")
        check(field(out, "head dim") == str(H // NH), "qwen2 head dim derived")

        # 2. Sharded llama, untied lm_head, f16 layers and f32 embeddings/norms.
        ll = os.path.join(tmp, "llama")
        os.mkdir(ll)
        t = qwen2_tensors(rng, H, I, NH, NKV, D, V, L, np.float16)
        t = {k: v for k, v in t.items() if not k.endswith(".bias")}
        t["lm_head.weight"] = rng.standard_normal((V, H)).astype(np.float32)
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].astype(np.float32)
        keys = sorted(t)
        parts = [keys[0::3], keys[1::3], keys[2::3]]
        wm = {}
        for i, p in enumerate(parts):
            fn = f"model-{i + 1:05d}-of-00003.safetensors"
            save_file({k: t[k] for k in p}, os.path.join(ll, fn))
            wm.update({k: fn for k in p})
        json.dump({"metadata": {}, "weight_map": wm}, open(os.path.join(ll, "model.safetensors.index.json"), "w"))
        json.dump({"model_type": "llama", "hidden_size": H, "intermediate_size": I,
                   "num_attention_heads": NH, "num_key_value_heads": NKV, "num_hidden_layers": L,
                   "vocab_size": V, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
                   "head_dim": D, "rope_theta": 500000.0, "tie_word_embeddings": False,
                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
                  open(os.path.join(ll, "config.json"), "w"))
        rc, out, err = run_inspect(args.dflash, ll)
        check(rc == 0, f"llama sharded: inspect exits 0 (stderr: {err.strip()[:300]})")
        n, by, shards = expected(ll)
        check(field(out, "parameters") == fmt_int(n), f"llama parameters {field(out, 'parameters')} == {fmt_int(n)}")
        want = ", ".join(f"{names[k]} {fmt_int(v)}" for k, v in sorted(by.items(), key=lambda kv: names[kv[0]]))
        check(field(out, "bytes by dtype") == want, f"llama bytes by dtype '{field(out, 'bytes by dtype')}' == '{want}'")
        check(field(out, "shards") == "3", "llama shards == 3")
        check(field(out, "tied embeddings") == "no", "llama untied")
        check((field(out, "rope") or "").startswith("llama3, theta 500000, factor 8"), f"llama rope '{field(out, 'rope')}'")

        # 3. A file the reference refuses (overlapping tensors) must be refused too.
        bad = os.path.join(tmp, "bad")
        os.mkdir(bad)
        hdr = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}).encode()
        with open(os.path.join(bad, "model.safetensors"), "wb") as f:
            f.write(len(hdr).to_bytes(8, "little") + hdr + bytes(16))
        ref_refuses = False
        try:
            load_file(os.path.join(bad, "model.safetensors"))
        except Exception:  # noqa: BLE001 - any refusal counts
            ref_refuses = True
        check(ref_refuses, "reference library refuses overlapping tensors")
        with open(os.path.join(q, "config.json")) as f:
            cfg = f.read()
        with open(os.path.join(bad, "config.json"), "w") as f:
            f.write(cfg)
        rc, out, err = run_inspect(args.dflash, bad)
        check(rc == 1 and "overlap" in err and "model.safetensors" in err,
              f"dflash refuses overlapping tensors with a clear error (rc {rc}: {err.strip()[:200]})")

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
