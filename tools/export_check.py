#!/usr/bin/env python3
"""Export check: load a drafter exported by `dflash train` with a PyTorch DFlash model written from
DESIGN.md §1 (not dflash code), feed it the same inputs as `dflash dev drafter-step`, compare logits.

Runs where PyTorch and transformers are installed (the GPU machine; CPU is enough):

    python3 tools/export_check.py --checkpoint RUN/checkpoint-N --target assets/tiny-qwen3 \
        --dflash build-static/dflash --work /tmp/export-check

Steps: tokenize three eval conversations with the target's tokenizer (HF AutoTokenizer), take
target features with HF transformers (hidden_states[L+1] for every tap L, fp32 on the bf16 weights),
choose anchors, run the PyTorch drafter on the exported weights, write the same inputs for
`dflash dev drafter-step`, run it, and compare the logits of every block (relative Frobenius error
and argmax agreement). Exit status 0 when the relative error is below --tol (default 1e-4).
"""
import argparse
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, D, theta):
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos[:, None, :] + torch.cat([-x2, x1], -1) * sin[:, None, :]


class DFlashDrafter(torch.nn.Module):
    """DESIGN.md §1: ctx = hidden_norm(fc(features)); block [anchor, MASK...]; per layer attention
    with queries from the block and keys/values from [ctx ; block] (shared k/v projections, q/k
    per-head RMSNorm, RoPE at absolute positions), SwiGLU MLP; logits = lm_head(norm(h))."""

    def __init__(self, cfg, weights, embed, lm_head):
        super().__init__()
        self.cfg, self.w, self.embed, self.lm_head = cfg, weights, embed, lm_head

    def block_logits(self, features, tokens, anchor):
        c, w = self.cfg, self.w
        H, NH, NKV, D = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        K, eps, theta = c["block_size"], c["rms_norm_eps"], c.get("rope_theta", 10000.0)
        mask_id = c["dflash_config"]["mask_token_id"]
        ctx = rms_norm(features[:anchor] @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        blk = torch.tensor([int(tokens[anchor])] + [mask_id] * (K - 1))
        h = self.embed[blk]
        pos_c = torch.arange(0, anchor)
        pos_b = torch.arange(anchor, anchor + K)
        for i in range(c["num_hidden_layers"]):
            p = lambda n: w[f"layers.{i}.{n}"]
            hn = rms_norm(h, p("input_layernorm.weight"), eps)
            q = rms_norm((hn @ p("self_attn.q_proj.weight").T).view(K, NH, D), p("self_attn.q_norm.weight"), eps)
            q = rope(q, pos_b, D, theta)
            kv_in = torch.cat([ctx, hn], 0)
            k = rms_norm((kv_in @ p("self_attn.k_proj.weight").T).view(-1, NKV, D), p("self_attn.k_norm.weight"), eps)
            k = rope(k, torch.cat([pos_c, pos_b]), D, theta)
            v = (kv_in @ p("self_attn.v_proj.weight").T).view(-1, NKV, D)
            k = k.repeat_interleave(NH // NKV, dim=1)
            v = v.repeat_interleave(NH // NKV, dim=1)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5, -1)
            h = h + torch.einsum("hqk,khd->qhd", att, v).reshape(K, NH * D) @ p("self_attn.o_proj.weight").T
            hn = rms_norm(h, p("post_attention_layernorm.weight"), eps)
            h = h + (torch.nn.functional.silu(hn @ p("mlp.gate_proj.weight").T) * (hn @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
        return rms_norm(h, w["norm.weight"], eps) @ self.lm_head.T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--dflash", required=True)
    ap.add_argument("--prompts", default="assets/data/eval_prompts.jsonl")
    ap.add_argument("--work", default="/tmp/export-check")
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    torch.manual_seed(0)
    cfg = json.load(open(os.path.join(a.checkpoint, "config.json")))
    weights = {k: v.float() for k, v in load_file(os.path.join(a.checkpoint, "model.safetensors")).items()}
    tok = AutoTokenizer.from_pretrained(a.target)
    target = AutoModelForCausalLM.from_pretrained(a.target, torch_dtype=torch.bfloat16).float().eval()
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.get_output_embeddings().weight.detach()
    drafter = DFlashDrafter(cfg, weights, embed, lm_head)
    taps = cfg["dflash_config"]["target_layer_ids"]
    K = cfg["block_size"]
    records = [json.loads(l) for l in open(a.prompts)][:3]
    worst, agree, total = 0.0, 0, 0
    for r, rec in enumerate(records):
        turns = rec.get("conversations") or rec.get("messages")
        user = next(t for t in turns if t.get("role", t.get("from")) in ("user", "human"))
        text = "<|im_start|>user\n" + user.get("content", user.get("value")) + "<|im_end|>\n<|im_start|>assistant\n"
        answer = next(t for t in turns if t.get("role", t.get("from")) in ("assistant", "gpt"))
        answer = answer.get("content", answer.get("value"))
        prompt_ids = tok(text)["input_ids"]
        ids = prompt_ids + tok(answer + "<|im_end|>\n")["input_ids"]
        T = len(ids)
        with torch.no_grad():
            hs = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
            feats = torch.cat([hs[L + 1][0] for L in taps], -1)
            anchors = sorted({len(prompt_ids), len(prompt_ids) + 1, (len(prompt_ids) + T) // 2, T - 2})
            ref = torch.stack([drafter.block_logits(feats, ids, a_) for a_ in anchors])
        inp = {f"params.{k}": v.contiguous() for k, v in weights.items()}
        inp.update({
            "embed": embed.clone().contiguous(), "lm_head": lm_head.clone().contiguous(), "features": feats.contiguous(),
            "tokens": torch.tensor(ids, dtype=torch.int32),
            "loss_mask": torch.tensor([0] * len(prompt_ids) + [1] * (T - len(prompt_ids)), dtype=torch.uint8),
            "doc_offsets": torch.tensor([0, T], dtype=torch.int32),
            "anchors": torch.tensor([[x, 0] for x in anchors], dtype=torch.int32),
        })
        ip, op = os.path.join(a.work, f"in{r}.safetensors"), os.path.join(a.work, f"out{r}.safetensors")
        save_file(inp, ip, metadata={"config": json.dumps(cfg), "gamma": "7"})
        subprocess.run([a.dflash, "dev", "drafter-step", ip, op], check=True)
        ours = load_file(op)["logits"].reshape(ref.shape)
        err = float((ours - ref).norm() / ref.norm())
        worst = max(worst, err)
        agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        total += ref.shape[0] * ref.shape[1]
        print(f"record {rec.get('id')}: T={T}, anchors {anchors}: logits rel. error {err:.2e}")
    print(f"export check: worst logits rel. error {worst:.2e} over {len(records)} records; "
          f"argmax agreement {agree}/{total}")
    sys.exit(0 if worst < a.tol else 1)


if __name__ == "__main__":
    main()
