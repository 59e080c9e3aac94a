#!/usr/bin/env python3
"""Builds small random HF checkpoints and fp32 reference outputs for dflash's target-model parity
tests (tests/target_parity_test.cpp).

Run where PyTorch and transformers 5 are installed (the device machine; CPU is enough, < 1 min):

    python3 tools/make_model_goldens.py --out tests/fixtures/models

For each model it writes <out>/<name>/ with the HF files of `save_pretrained` (bf16 weights,
config.json) and golden.safetensors:
    p{i}.input_ids       int64 [T]       random token ids (2 prompts, odd lengths)
    p{i}.layer{L}.out    f32 [T, H]      output of decoder layer L (forward hook on the layer,
                                         i.e. before the final norm, also for the last layer)
    p{i}.final_norm.out  f32 [T, H]      output of the final RMSNorm
    p{i}.logits          f32 [T, V]
    p{i}.greedy          int64 [16]      16 greedy tokens (argmax, no end-of-sequence stop)
with __metadata__ {"layers": "0,1,2", "greedy_tokens": "16", "transformers": version, ...}.
Outputs are computed by HF in float32 on the bf16 weights as saved (reloaded from disk, eager
attention). Weights are random but scaled so that activations are O(1) and greedy choices are not
near-ties: the script picks, per model, the first seed whose smallest top-1/top-2 logit margin along
the greedy paths is at least 2e-3.

Models:
  qwen2-bias    Qwen2ForCausalLM (q/k/v bias), GQA 4/2, head_dim 16, tied embeddings, default RoPE.
  llama3-rope   LlamaForCausalLM, GQA 4/1, head_dim 32, untied LM head, llama3 RoPE scaling written
                in the classic config keys (`rope_theta` + `rope_scaling`).
  llama-yarn    LlamaForCausalLM, GQA 4/2, head_dim 16, untied, attention_bias and mlp_bias, yarn
                RoPE in transformers-5 `rope_parameters`.
"""
import argparse
import json
import math
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 512
GREEDY = 16
PROMPT_LENS = (13, 29)
MIN_MARGIN = 2e-3
MAX_BYTES = 1_000_000  # per checkpoint folder

SPECS = {
    "qwen2-bias": dict(
        config_cls=Qwen2Config,
        model_cls=Qwen2ForCausalLM,
        classic_rope=False,
        kwargs=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        ),
    ),
    "llama3-rope": dict(
        config_cls=LlamaConfig,
        model_cls=LlamaForCausalLM,
        classic_rope=True,
        kwargs=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, head_dim=32,
            max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64},
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        ),
    ),
    "llama-yarn": dict(
        config_cls=LlamaConfig,
        model_cls=LlamaForCausalLM,
        classic_rope=False,
        kwargs=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            # factor == max_position_embeddings / original_max_position_embeddings, so every
            # transformers version derives the same factor.
            max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
            attention_bias=True, mlp_bias=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 128, "beta_fast": 32.0,
                             "beta_slow": 1.0},
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        ),
    ),
}


def randomize(model, seed):
    """O(1) activations: embeddings N(0,1), linear weights N(0, 1/fan_in), norm weights 1 + N(0, 0.2²),
    biases N(0, 0.2²)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * r)
            elif name.endswith(".bias"):
                p.copy_(0.2 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            else:
                p.copy_(r / math.sqrt(p.shape[1]))


def rewrite_rope_classic(folder):
    """config.json: `rope_parameters` → classic `rope_theta` + `rope_scaling` (pre-v5 layout)."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    rp = cfg.pop("rope_parameters", None) or cfg.pop("rope_scaling", None)
    assert isinstance(rp, dict), f"{path}: no rope_parameters to rewrite"
    rp = dict(rp)
    cfg["rope_theta"] = rp.pop("rope_theta", cfg.get("rope_theta"))
    assert cfg["rope_theta"] is not None, f"{path}: no rope_theta"
    cfg["rope_scaling"] = rp
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def rope_of(config):
    rp = getattr(config, "rope_parameters", None)
    if rp is None:
        rp = getattr(config, "rope_scaling", None) or {}
    return dict(rp)


def layer_outputs(model, ids):
    """Outputs of every decoder layer (forward hooks), final norm output and logits, fp32."""
    outs = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def hook(_mod, _inp, out, i=i):
            outs[i] = (out[0] if isinstance(out, (tuple, list)) else out).detach()[0].clone()
        hooks.append(layer.register_forward_hook(hook))
    normed = {}
    hooks.append(model.model.norm.register_forward_hook(
        lambda _m, _i, out: normed.__setitem__("x", out.detach()[0].clone())))
    try:
        with torch.no_grad():
            res = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    hs = res.hidden_states
    n = len(model.model.layers)
    assert len(outs) == n and len(hs) == n + 1, (len(outs), len(hs))
    for i in range(n - 1):  # hidden_states[i+1] is layer i's output except for the last layer
        assert torch.equal(hs[i + 1][0], outs[i]), f"hook/hidden_states disagree at layer {i}"
    if not torch.equal(hs[n][0], normed["x"]):
        print("note: hidden_states[-1] is not the final-norm output in this transformers version")
    return outs, normed["x"], res.logits.detach()[0].float().clone()


def greedy(model, ids, n):
    """n argmax steps, full forward each step (no cache, no end-of-sequence stop). Returns the
    tokens and the smallest top-1/top-2 margin seen."""
    seq = ids.clone()
    toks, margin = [], float("inf")
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=seq[None], use_cache=False).logits[0, -1].float()
            top = torch.topk(logits, 2)
            margin = min(margin, float(top.values[0] - top.values[1]))
            t = int(torch.argmax(logits))
            toks.append(t)
            seq = torch.cat([seq, torch.tensor([t], dtype=seq.dtype)])
    return torch.tensor(toks, dtype=torch.int64), margin


def build(name, spec, out_root, seed0):
    folder = os.path.join(out_root, name)
    for attempt in range(20):
        seed = seed0 + 1000 * attempt
        torch.manual_seed(seed)
        cfg = spec["config_cls"](**spec["kwargs"])
        model = spec["model_cls"](cfg)
        randomize(model, seed)
        model = model.to(torch.bfloat16)
        if os.path.isdir(folder):
            shutil.rmtree(folder)
        model.save_pretrained(folder)
        if spec["classic_rope"]:
            rewrite_rope_classic(folder)
        # Reload from disk exactly as a user would, then compute in fp32 on the bf16 values.
        ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
        ref = ref.float().eval()
        want = spec["kwargs"]["rope_parameters"]
        got = rope_of(ref.config)
        for k, v in want.items():
            have = got.get(k, getattr(ref.config, k, None))
            assert have == v, f"{name}: reloaded rope {k}={have!r}, wanted {v!r} ({got})"
        saved, loaded = model.state_dict(), ref.state_dict()
        assert sorted(saved) == sorted(loaded), f"{name}: reload changed the weight names"
        for n1, p1 in saved.items():
            assert torch.equal(p1.float(), loaded[n1]), f"{name}: weight {n1} changed on reload"

        g = torch.Generator().manual_seed(seed + 7)
        tensors, margins = {}, []
        for i, T in enumerate(PROMPT_LENS):
            ids = torch.randint(0, VOCAB, (T,), generator=g, dtype=torch.int64)
            outs, normed, logits = layer_outputs(ref, ids)
            toks, margin = greedy(ref, ids, GREEDY)
            margins.append(margin)
            tensors[f"p{i}.input_ids"] = ids
            for L, x in outs.items():
                tensors[f"p{i}.layer{L}.out"] = x.float().contiguous()
            tensors[f"p{i}.final_norm.out"] = normed.float().contiguous()
            tensors[f"p{i}.logits"] = logits.contiguous()
            tensors[f"p{i}.greedy"] = toks
        if min(margins) < MIN_MARGIN:
            print(f"{name}: seed {seed} has a greedy near-tie (margin {min(margins):.2e}), retrying")
            continue
        meta = {
            "layers": ",".join(str(i) for i in range(len(ref.model.layers))),
            "greedy_tokens": str(GREEDY),
            "seed": str(seed),
            "min_greedy_margin": f"{min(margins):.4g}",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "compute": "float32 on bf16 weights, eager attention",
        }
        save_file(tensors, os.path.join(folder, "golden.safetensors"), metadata=meta)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        assert size < MAX_BYTES, f"{name}: {size} bytes, over the {MAX_BYTES} budget"
        print(f"{name}: {folder} ({size} bytes), seed {seed}, min greedy margin "
              f"{min(margins):.3g}, files {sorted(os.listdir(folder))}")
        return
    sys.exit(f"{name}: no seed without greedy near-ties in 20 attempts")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder, e.g. tests/fixtures/models")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--only", nargs="*", choices=sorted(SPECS), help="build only these models")
    args = ap.parse_args()
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    os.makedirs(args.out, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for name in args.only or SPECS:
        build(name, SPECS[name], args.out, args.seed)


if __name__ == "__main__":
    main()
