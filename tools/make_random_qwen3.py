#!/usr/bin/env python3
"""A Qwen3-8B-shaped target with random weights, for throughput runs of `dflash train` (device side).

Writes OUT/config.json (Qwen3ForCausalLM with the Qwen3-8B sizes: hidden 4096, 36 layers, 32/8
heads, head_dim 128, intermediate 12288, vocabulary 151936, untied LM head), one safetensors shard
per layer plus one for the embeddings, LM head and final norm, model.safetensors.index.json, and
the tokenizer copied from TOKENIZER_DIR (tokenizer.json or tokenizer.json.xz, tokenizer_config.json
when present). The features such a target gives are meaningless; the shapes and the work are the
real model's.

Weights are bf16 with random sign and mantissa and an exponent of 2^-7 or 2^-6 (magnitudes in
[0.0078, 0.031)), made from os.urandom by fixing the high byte of each value: the standard library
only, no numpy or torch (the GPU machine may have neither), about 16 GB written. Norm weights are 1.

  python3 tools/make_random_qwen3.py OUT --tokenizer DIR [--layers 36]
"""
import argparse
import json
import lzma
import os
import shutil
import struct

H, I, NH, NKV, D, V = 4096, 12288, 32, 8, 128, 151936

# High byte of a little-endian bf16: the sign and the top 7 exponent bits. 0x3C with the low
# byte's top bit (the last exponent bit) gives exponent 120 or 121.
_HIGH = bytes((b & 0x80) | 0x3C for b in range(256))
_ONE = struct.pack("<H", 0x3F80)  # bf16 1.0


def random_bf16(n):
    """n random bf16 values (bytes, little-endian) in ±[2^-7, 2^-5)."""
    buf = bytearray(os.urandom(2 * n))
    buf[1::2] = buf[1::2].translate(_HIGH)
    return buf


def write_shard(path, tensors):
    """tensors: list of (name, shape, bytes) in bf16; writes one safetensors file."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, data in tensors:
        assert len(data) == 2 * _count(shape), name
        header[name] = {"dtype": "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, data in tensors:
            f.write(data)


def _count(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def mat(name, rows, cols):
    return (name, (rows, cols), random_bf16(rows * cols))


def ones(name, n):
    return (name, (n,), _ONE * n)


def copy_tokenizer(src, out):
    if os.path.exists(os.path.join(src, "tokenizer.json")):
        shutil.copy(os.path.join(src, "tokenizer.json"), out)
    else:
        with lzma.open(os.path.join(src, "tokenizer.json.xz")) as s, \
                open(os.path.join(out, "tokenizer.json"), "wb") as d:
            shutil.copyfileobj(s, d)
    if os.path.exists(os.path.join(src, "tokenizer_config.json")):
        shutil.copy(os.path.join(src, "tokenizer_config.json"), out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokenizer", required=True, help="folder with tokenizer.json[.xz]")
    ap.add_argument("--layers", type=int, default=36)
    a = ap.parse_args()
    L = a.layers
    os.makedirs(a.out, exist_ok=True)
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": H,
        "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": NH,
        "num_key_value_heads": NKV, "head_dim": D, "vocab_size": V,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
        "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    n = L + 1
    index = {}

    def shard(i, tensors):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        write_shard(os.path.join(a.out, name), tensors)
        for t in tensors:
            index[t[0]] = name

    shard(0, [mat("model.embed_tokens.weight", V, H), mat("lm_head.weight", V, H),
              ones("model.norm.weight", H)])
    for l in range(L):
        p = f"model.layers.{l}."
        shard(l + 1, [
            ones(p + "input_layernorm.weight", H), ones(p + "post_attention_layernorm.weight", H),
            mat(p + "self_attn.q_proj.weight", NH * D, H),
            mat(p + "self_attn.k_proj.weight", NKV * D, H),
            mat(p + "self_attn.v_proj.weight", NKV * D, H),
            mat(p + "self_attn.o_proj.weight", H, NH * D),
            ones(p + "self_attn.q_norm.weight", D), ones(p + "self_attn.k_norm.weight", D),
            mat(p + "mlp.gate_proj.weight", I, H), mat(p + "mlp.up_proj.weight", I, H),
            mat(p + "mlp.down_proj.weight", H, I),
        ])
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    copy_tokenizer(a.tokenizer, a.out)
    print(f"wrote {a.out}: {L} layers, {n} shards")


if __name__ == "__main__":
    main()
