#!/usr/bin/env python3
"""Times the HF transformers forward of a random-weight target on the GPU machine (PyTorch there), the
figure `dflash bench --target-only` is compared with (issue 17: Qwen2.5-32B at 4 x 2048 tokens).

  python3 hf_target_forward.py [--preset qwen2.5-32b] [--rows 4] [--seq 2048] [--runs 10] [--taps 1,16,...]

Two timings, each the median of --runs after 2 warm-up runs, bf16, sdpa attention, no grad:
  full:  model(ids, output_hidden_states=True) - every layer and the LM head (what a PyTorch trainer runs);
  taps:  only the decoder layers up to the deepest tap, no LM head (what a DFlash target worker needs).
Prints one JSON line per timing: ms, tokens/s and the peak device memory in GiB. Random weights are made on
the GPU (seed 0); nothing is read from or written to disk."""
import argparse, json, time
import torch
from transformers import AutoConfig, AutoModelForCausalLM

PRESETS = {
    # Qwen/Qwen2.5-32B config.json shapes (q/k/v biases are implied by the Qwen2 architecture).
    "qwen2.5-32b": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, use_sliding_window=False),
    # Qwen/Qwen3-8B shapes (as ../shared/tools/make_q8b.py).
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
}

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="qwen2.5-32b", choices=sorted(PRESETS))
ap.add_argument("--rows", type=int, default=4)
ap.add_argument("--seq", type=int, default=2048)
ap.add_argument("--runs", type=int, default=10)
ap.add_argument("--taps", default="", help="target layer ids (default: 5 spread over the layers)")
a = ap.parse_args()

kw = dict(PRESETS[a.preset])
cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
cfg._attn_implementation = "sdpa"
n_layers = cfg.num_hidden_layers
taps = [int(x) for x in a.taps.split(",")] if a.taps else [1 + i * (n_layers - 4) // 4 for i in range(5)]
torch.manual_seed(0)
t0 = time.time()
with torch.device("cuda"):
    torch.set_default_dtype(torch.bfloat16)
    model = AutoModelForCausalLM.from_config(cfg)
    torch.set_default_dtype(torch.float32)
model.eval()
torch.cuda.synchronize()
print(json.dumps({"preset": a.preset, "made_s": round(time.time() - t0, 1), "taps": taps,
                  "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 2)}), flush=True)
ids = torch.randint(0, cfg.vocab_size, (a.rows, a.seq), device="cuda")
tokens = a.rows * a.seq


def full():
    return model(input_ids=ids, output_hidden_states=True).hidden_states


def taps_only():
    # The decoder up to the deepest tap (hidden_states[L + 1] is the output of layer L), no LM head.
    inner, keep = model.model, inner_layers[: max(taps) + 1]
    inner.layers = keep
    try:
        return inner(input_ids=ids, output_hidden_states=True).hidden_states
    finally:
        inner.layers = inner_layers


inner_layers = model.model.layers
for name, fn in (("full", full), ("taps", taps_only)):
    with torch.no_grad():
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(a.runs):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
    ms = sorted(times)[len(times) // 2]
    print(json.dumps({"timing": name, "rows": a.rows, "seq": a.seq, "runs": a.runs, "median_ms": round(ms, 2),
                      "min_ms": round(min(times), 2), "tokens_per_s": round(tokens / ms * 1e3),
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                      "torch": torch.__version__}), flush=True)
