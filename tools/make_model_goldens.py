#!/usr/bin/env python3
"""Builds small random HF checkpoints and fp32 reference outputs for dflash's target-model parity
tests (tests/target_parity_test.cpp).

Run where PyTorch and transformers 5 are installed (CPU is enough, a few minutes; the committed
fixtures were made with torch 2.11.0 and transformers 5.17.0, the device's versions, on the CPU):

    python3 tools/make_model_goldens.py --out tests/fixtures/models [--only NAME ...]

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
the greedy paths is at least 2e-3. For mixture-of-experts models it also asks that no routing
decision be a near-tie: along the forwards of both prompts, the gap between the k-th and (k+1)-th
router logit of every token and MoE layer, divided by the standard deviation of that layer's
logits, must be at least MIN_ROUTER_GAP (recorded as "min_router_gap"), so that a bf16 forward
routes every token as the fp32 one does.

Models:
  qwen2-bias    Qwen2ForCausalLM (q/k/v bias), GQA 4/2, head_dim 16, tied embeddings, default RoPE.
  llama3-rope   LlamaForCausalLM, GQA 4/1, head_dim 32, untied LM head, llama3 RoPE scaling written
                in the classic config keys (`rope_theta` + `rope_scaling`).
  llama-yarn    LlamaForCausalLM, GQA 4/2, head_dim 16, untied, attention_bias and mlp_bias, yarn
                RoPE in transformers-5 `rope_parameters`.
  qwen3-moe     Qwen3MoeForCausalLM, GQA 4/2, head_dim 64, tied, 8 experts (width 16) top-2 with
                norm_topk_prob, layer 2 of 3 dense through mlp_only_layers, rope theta 1e6.
  qwen3-moe-window  Qwen3MoeForCausalLM, 4 experts top-3 without norm_topk_prob,
                decoder_sparse_step 2 (layers 1 and 3 sparse), sliding window 8 on every layer.
  gpt-oss       GptOssForCausalLM, 3 layers, GQA 4/1, head_dim 64, untied, q/k/v/o biases, sinks,
                sliding window 8 on even layers, GptOssConfig's default yarn RoPE (factor 32,
                truncate false), 8 experts (width 16) top-2 in bf16 (the x·W layout of
                `gate_up_proj`).
  gpt-oss-mxfp4 2 layers, 4 experts (width 64) top-2 stored as MXFP4 (`*_blocks`/`*_scales`, as
                the released checkpoints); HF dequantises them at load and computes in float32.
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
from transformers import (AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, LlamaConfig,
                          LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

VOCAB = 512
GREEDY = 16
PROMPT_LENS = (13, 29)
MIN_MARGIN = 2e-3
MIN_ROUTER_GAP = 0.01
MAX_ATTEMPTS = 200
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
    "qwen3-moe": dict(
        config_cls=Qwen3MoeConfig,
        model_cls=Qwen3MoeForCausalLM,
        classic_rope=False,
        kwargs=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[2], max_position_embeddings=512, rms_norm_eps=1e-6,
            tie_word_embeddings=True, use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        ),
    ),
    "qwen3-moe-window": dict(
        config_cls=Qwen3MoeConfig,
        model_cls=Qwen3MoeForCausalLM,
        classic_rope=False,
        kwargs=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
            num_experts=4, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2,
            max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
            use_sliding_window=True, sliding_window=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        ),
    ),
    "gpt-oss": dict(
        config_cls=GptOssConfig,
        model_cls=GptOssForCausalLM,
        classic_rope=False,
        kwargs=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=1, head_dim=64, num_local_experts=8,
            num_experts_per_tok=2, sliding_window=8, max_position_embeddings=131072,
            rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        ),
    ),
    "gpt-oss-mxfp4": dict(
        config_cls=GptOssConfig,
        model_cls=GptOssForCausalLM,
        classic_rope=False,
        mxfp4=True,
        kwargs=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, head_dim=64, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=8, max_position_embeddings=131072,
            rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        ),
    ),
}

FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def randomize(model, seed):
    """O(1) activations: embeddings N(0,1), linear weights N(0, 1/fan_in), norm weights 1 + N(0, 0.2²),
    biases N(0, 0.2²), attention sinks N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    transposed_experts = model.config.model_type == "gpt_oss"  # GptOssExperts: x·W, [E, in, out]
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * r)
            elif leaf == "bias" or leaf.endswith("_bias"):
                p.copy_(0.2 * r)
            elif leaf == "sinks":
                p.copy_(r)
            elif "embed_tokens" in name:
                p.copy_(r)
            elif p.dim() == 3:
                p.copy_(r / math.sqrt(p.shape[1] if transposed_experts else p.shape[2]))
            else:
                p.copy_(r / math.sqrt(p.shape[1]))


def mxfp4_quantize(w):
    """Rounds w [..., n] (n a multiple of 32) to MXFP4 along its last axis: per group of 32 an E8M0
    scale 2^e with e = ceil(log2(max|w| / 6)), values rounded to the nearest E2M1 magnitude
    (ties to the smaller). Returns (blocks uint8 [..., n/32, 16], scales uint8 [..., n/32],
    dequantised float32 [..., n]), nibble order as HF's `_convert_moe_packed_tensors` reads it:
    element 2j in the low nibble of byte j, 2j+1 in the high nibble."""
    w = w.float()
    *prefix, n = w.shape
    g = w.reshape(*prefix, n // 32, 32)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp_min(2.0 ** -100)
    e = torch.ceil(torch.log2(amax / 6.0))
    x = g / torch.exp2(e)
    lut = torch.tensor(FP4_VALUES)
    mag = (x.abs()[..., None] - lut).abs().argmin(dim=-1)  # nearest magnitude index 0..7
    code = (mag | torch.where(x < 0, 8, 0)).to(torch.uint8)
    deq = torch.where(x < 0, -lut[mag], lut[mag]) * torch.exp2(e)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    scales = (e[..., 0] + 127).to(torch.uint8)
    return blocks, scales, deq.reshape(*prefix, n)


def quantize_experts(model):
    """Rounds every GptOssExperts weight to MXFP4 in place (so that the bf16 model equals its MXFP4
    form) and returns the checkpoint tensors of that form: `*_blocks`/`*_scales` over the
    [E, out, in] view (HF stores gate_up_proj as [E, in, out] and transposes on dequantisation)."""
    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not (name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj")):
                continue
            blocks, scales, deq = mxfp4_quantize(p.detach().transpose(1, 2))
            p.copy_(deq.transpose(1, 2).to(p.dtype))
            out[name + "_blocks"] = blocks.contiguous()
            out[name + "_scales"] = scales.contiguous()
    return out


def write_mxfp4(folder, packed):
    """Replaces the bf16 expert tensors of <folder>/model.safetensors by their MXFP4 blocks and
    scales, and declares quantization_config in config.json, as the released gpt-oss checkpoints
    do. Checks HF's dequantisation of the written data against the values the model holds."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    for name, t in packed.items():
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            deq = convert_moe_packed_tensors(t, packed[base + "_scales"])
            same = torch.equal(deq, tensors[base].to(deq.dtype))
            assert same, f"{base}: mxfp4 round trip differs"
            del tensors[base]
    tensors.update(packed)
    save_file(tensors, path, metadata={"format": "pt"})
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def router_gaps(model, ids):
    """Smallest gap between the k-th and (k+1)-th router logit over the tokens of each MoE layer,
    divided by the standard deviation of that layer's logits (inf for a dense model)."""
    k = getattr(model.config, "num_experts_per_tok", None)
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    logits = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: logits.append(out[0].detach().float()))
             for r in routers]
    try:
        with torch.no_grad():
            model(input_ids=ids[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    gap = float("inf")
    for l in logits:
        top = torch.topk(l, k + 1, dim=-1).values if k < l.shape[-1] else None
        if top is None:
            continue
        gap = min(gap, float((top[:, k - 1] - top[:, k]).min() / l.std()))
    return gap


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


def load_reference(folder, spec):
    """The model as a user loads it from `folder` (MXFP4 experts dequantised by HF), in fp32."""
    kwargs = dict(attn_implementation="eager")
    if spec.get("mxfp4"):
        from transformers import Mxfp4Config
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs).float().eval()


def build(name, spec, out_root, seed0):
    folder = os.path.join(out_root, name)
    best = None
    for attempt in range(MAX_ATTEMPTS):
        seed = seed0 + 1000 * attempt
        torch.manual_seed(seed)
        cfg = spec["config_cls"](**spec["kwargs"])
        model = spec["model_cls"](cfg)
        randomize(model, seed)
        model = model.to(torch.bfloat16)
        packed = quantize_experts(model) if spec.get("mxfp4") else None
        if os.path.isdir(folder):
            shutil.rmtree(folder)
        model.save_pretrained(folder)
        if spec["classic_rope"]:
            rewrite_rope_classic(folder)
        if packed:
            write_mxfp4(folder, packed)
        # Reload from disk exactly as a user would, then compute in fp32 on the bf16 values.
        ref = load_reference(folder, spec)
        want = spec["kwargs"].get("rope_parameters", {})
        got = rope_of(ref.config)
        for k, v in want.items():
            have = got.get(k, getattr(ref.config, k, None))
            assert have == v, f"{name}: reloaded rope {k}={have!r}, wanted {v!r} ({got})"
        saved, loaded = model.state_dict(), ref.state_dict()
        assert sorted(saved) == sorted(loaded), f"{name}: reload changed the weight names"
        for n1, p1 in saved.items():
            assert torch.equal(p1.float(), loaded[n1]), f"{name}: weight {n1} changed on reload"

        g = torch.Generator().manual_seed(seed + 7)
        prompts = [torch.randint(0, VOCAB, (T,), generator=g, dtype=torch.int64)
                   for T in PROMPT_LENS]
        gap = min(router_gaps(ref, ids) for ids in prompts)
        if gap < MIN_ROUTER_GAP:
            print(f"{name}: seed {seed} has a routing near-tie (gap {gap:.2e} std), retrying")
            continue
        tensors, margins = {}, []
        for i, ids in enumerate(prompts):
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
        if gap != float("inf"):
            meta["min_router_gap"] = f"{gap:.4g}"
        if packed:
            meta["compute"] = "float32 on mxfp4 experts dequantised by HF and bf16 weights, eager"
        save_file(tensors, os.path.join(folder, "golden.safetensors"), metadata=meta)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        assert size < MAX_BYTES, f"{name}: {size} bytes, over the {MAX_BYTES} budget"
        print(f"{name}: {folder} ({size} bytes), seed {seed}, min greedy margin "
              f"{min(margins):.3g}, min router gap {gap:.3g}, files {sorted(os.listdir(folder))}")
        return
    sys.exit(f"{name}: no seed without greedy or routing near-ties in {MAX_ATTEMPTS} attempts")


def main():
    transformers.logging.disable_progress_bar()
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
