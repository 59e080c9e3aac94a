"""Differential test: the C++ DFlash drafter training step against the JAX reference.

For 12 seeded random configurations (GQA ratios 1/2/3, head_dim 8/16/32, block sizes 4..16,
1..3 drafter layers and taps, gamma 7 and 0, 1..3 packed documents per row with random lengths,
partial loss masks and trailing padding, explicit anchors including adjacent ones and one at a
document's last position) we write the problem to a safetensors file, run
`dflash dev drafter-step IN OUT` (block_targets + drafter_train_step<float>, grad scale 1/Σw) and
compare with tests/reference/dflash_ref.py evaluated in float64 on the same float32 inputs
(jax.value_and_grad):
  - loss: relative error < 1e-5;
  - gradients: per parameter, Frobenius relative error < 1e-5;
  - argmax per slot: equal, except where the reference's top-2 logits are within 1e-5;
  - accuracy, tau and per-slot accuracy: exactly equal (computed from the reference argmax, with
    the C++ choice taken at those near-ties).
Prints one summary line per configuration; on failure prints the first failure with details and
exits 1.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The reference is float64 and tiny: XLA's backend optimisations only cost compile time (~2x).
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import dflash_ref  # noqa: E402

SEED = 20250611
TOL = 1e-5

# (NKV, GQA ratio, head_dim, block size, layers, taps, gamma, documents)
CONFIGS = [
    (1, 1, 8, 4, 1, 1, 7.0, 1),
    (2, 2, 16, 16, 2, 2, 7.0, 2),
    (1, 3, 32, 8, 1, 3, 0.0, 3),
    (2, 1, 32, 5, 2, 1, 7.0, 3),
    (1, 2, 8, 13, 3, 2, 0.0, 1),
    (2, 3, 8, 6, 1, 2, 7.0, 2),
    (1, 1, 16, 16, 2, 3, 7.0, 1),
    (3, 2, 16, 7, 1, 1, 0.0, 2),
    (1, 3, 16, 9, 2, 2, 7.0, 3),
    (2, 2, 32, 4, 1, 3, 0.0, 2),
    (1, 2, 32, 11, 2, 1, 7.0, 1),
    (3, 1, 8, 12, 3, 2, 7.0, 3),
]


def param_shapes(c):
    H, I, D = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    QD, KD = c["num_attention_heads"] * D, c["num_key_value_heads"] * D
    taps = len(c["dflash_config"]["target_layer_ids"])
    shapes = {"fc.weight": (H, taps * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for l in range(c["num_hidden_layers"]):
        p = f"layers.{l}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (QD, H), p + "self_attn.k_proj.weight": (KD, H),
            p + "self_attn.v_proj.weight": (KD, H), p + "self_attn.o_proj.weight": (H, QD),
            p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I)})
    return shapes


def make_problem(idx, spec):
    nkv, ratio, D, K, L, taps, gamma, ndocs = spec
    rng = np.random.default_rng(SEED + idx)
    H = int(rng.choice([16, 24, 32]))
    V = int(rng.integers(29, 71))
    n_target = int(rng.integers(taps + 1, 9))
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": H, "intermediate_size": int(rng.integers(17, 41)),
        "num_hidden_layers": L, "num_attention_heads": nkv * ratio, "num_key_value_heads": nkv,
        "head_dim": D, "vocab_size": V, "rms_norm_eps": 1e-6,
        "rope_theta": float(rng.choice([10000.0, 1e6])), "rope_scaling": None,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "attention_bias": False,
        "hidden_act": "silu", "block_size": K, "num_target_layers": n_target,
        "dflash_config": {"mask_token_id": V - 1,
                          "target_layer_ids":
                              sorted(rng.choice(n_target, taps, replace=False).tolist())},
    }
    params = {}
    for name, shape in param_shapes(cfg).items():
        if len(shape) == 1:
            params[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            params[name] = (rng.standard_normal(shape) / np.sqrt(shape[1]) * 1.5).astype(np.float32)
    embed = rng.standard_normal((V, H)).astype(np.float32)
    lm_head = (0.5 * rng.standard_normal((V, H))).astype(np.float32)

    # Documents of random lengths (>= 2), then 0..3 padding tokens.
    lens = [int(rng.integers(max(3, K // 2), 3 * K + 6)) for _ in range(ndocs)]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(offsets[-1] + rng.integers(0, 4))
    tokens = rng.integers(0, V - 1, size=T).astype(np.int32)  # never the mask id
    loss_mask = (rng.random(T) < 0.8).astype(np.uint8)
    loss_mask[offsets[-1]:] = 0
    features = rng.standard_normal((T, taps * H)).astype(np.float32)

    anchors = []
    for d in range(ndocs):
        s, e = int(offsets[d]), int(offsets[d + 1])
        picks = {e - 1, s}  # last valid position (no label left) and the document start
        a = int(rng.integers(s, e - 1))
        picks.update({a, min(a + 1, e - 1)})  # adjacent anchors (closer than a block)
        picks.update(int(x) for x in rng.integers(s, e, size=int(rng.integers(1, 4))))
        anchors += [(p, d) for p in sorted(picks)]
    return cfg, params, embed, lm_head, features, tokens, loss_mask, offsets, anchors, gamma


def run_cpp(dflash, tmp, idx, prob):
    cfg, params, embed, lm_head, features, tokens, loss_mask, offsets, anchors, gamma = prob
    inp, out = os.path.join(tmp, f"in{idx}.safetensors"), os.path.join(tmp, f"out{idx}.safetensors")
    tensors = {f"params.{k}": v for k, v in params.items()}
    tensors.update({"embed": embed, "lm_head": lm_head, "features": features, "tokens": tokens,
                    "loss_mask": loss_mask, "doc_offsets": offsets,
                    "anchors": np.array(anchors, np.int32).reshape(-1, 2)})
    save_file(tensors, inp, metadata={"config": json.dumps(cfg), "gamma": repr(gamma)})
    r = subprocess.run([dflash, "dev", "drafter-step", inp, out], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"dflash dev drafter-step failed (rc {r.returncode}):\n{r.stderr}")
    return load_file(out)


def reference_fn(prob):
    """jit-compiled p -> ((loss, logits), grads) of the reference in float64 for `prob`, with
    labels and weights as arguments (so that one compilation serves both calls of run_ref).
    Loss = Σ w·CE / Σ w (DESIGN.md §1, as dflash_ref.loss_fn)."""
    cfg, params, embed, lm_head, features, tokens, loss_mask, offsets, anchors, gamma = prob
    rc = dict(cfg)
    rc["mask_token_id"] = cfg["dflash_config"]["mask_token_id"]
    f64 = lambda a: jnp.asarray(a, jnp.float64)
    docs = offsets.tolist()

    def loss(p, labels, w):
        logits = dflash_ref.drafter_logits_packed(p, rc, f64(features), tokens, docs, anchors,
                                                  f64(embed), f64(lm_head))
        lse = jax.scipy.special.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
        return jnp.sum(w * (lse - picked)) / jnp.sum(w), logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def plant_predictions(prob, ref_fn, rng):
    """Makes accuracy and tau non-trivial: sets ~70% of the label tokens x[a+k] (k >= 1) that are
    no block's anchor token to the reference's argmax (logits depend on tokens only through anchor
    tokens, so they do not change). Returns the new problem."""
    p64 = {k: jnp.asarray(v, jnp.float64) for k, v in prob[1].items()}
    tokens, offsets, anchors, K = prob[5].copy(), prob[7], prob[8], prob[0]["block_size"]
    labels, w, _ = dflash_ref.targets(tokens, prob[6], offsets.tolist(), anchors, K, prob[9])
    (_, logits), _ = ref_fn(p64, labels, w)
    am = np.asarray(logits).argmax(-1)
    anchor_pos = {a for a, _ in anchors}
    for b, (a, d) in enumerate(anchors):
        for k in range(1, K):
            if a + k < offsets[d + 1] and a + k not in anchor_pos and rng.random() < 0.7:
                tokens[a + k] = am[b, k]
    return prob[:5] + (tokens,) + prob[6:]


def run_ref(prob, ref_fn, cross_check=False):
    """Loss, gradients, logits, labels, counted of the reference (float64).

    The packed (masked, fixed-shape) formulation is used for speed; with `cross_check` its logits
    are also compared with the per-block slicing formulation dflash_ref.drafter_logits.
    """
    cfg, params, embed, lm_head, features, tokens, loss_mask, offsets, anchors, gamma = prob
    p64 = {k: jnp.asarray(v, jnp.float64) for k, v in params.items()}
    labels, w, counted = dflash_ref.targets(tokens, loss_mask, offsets.tolist(), anchors,
                                            cfg["block_size"], gamma)
    (loss, logits), grads = ref_fn(p64, labels, w)
    logits = np.asarray(logits)
    if cross_check:
        rc = dict(cfg)
        rc["mask_token_id"] = cfg["dflash_config"]["mask_token_id"]
        f64 = lambda a: jnp.asarray(a, jnp.float64)
        sliced = np.asarray(jax.jit(lambda p: dflash_ref.drafter_logits(
            p, rc, f64(features), tokens, offsets.tolist(), anchors, f64(embed),
            f64(lm_head)))(p64))
        err = np.abs(sliced - logits).max() / np.abs(sliced).max()
        if not err < 1e-12:
            raise AssertionError(f"dflash_ref: packed and sliced logits differ (rel {err:.2e})")
        print(f"  reference self-check: packed vs sliced (per-block) logits rel diff {err:.1e}")
    return float(loss), {k: np.asarray(v) for k, v in grads.items()}, logits, labels, counted


def compare(idx, prob, cpp, ref):
    """Returns (summary, failure message or None)."""
    cfg = prob[0]
    loss, grads, logits, labels, counted = ref
    fails = []
    loss_c = float(cpp["loss"][0])
    loss_err = abs(loss_c - loss) / abs(loss)
    if loss_err > TOL:
        fails.append(f"loss: C++ {loss_c!r} vs reference {loss!r} (rel {loss_err:.2e})")
    worst, worst_name = 0.0, ""
    for name, g in grads.items():
        gc = cpp[f"grad.{name}"].astype(np.float64)
        if gc.shape != g.shape:
            fails.append(f"grad.{name}: shape {gc.shape} vs {g.shape}")
            continue
        err = np.linalg.norm(gc - g) / max(np.linalg.norm(g), 1e-30)
        if err > worst:
            worst, worst_name = err, name
        if err > TOL:
            i = np.unravel_index(np.argmax(np.abs(gc - g)), g.shape)
            fails.append(f"grad.{name}: Frobenius rel error {err:.2e} (worst element {i}: C++ "
                         f"{gc[i]:.8g} vs reference {g[i]:.8g})")
    # Argmax, with near-ties of the reference exempted.
    am_c = cpp["argmax"]
    am_r = logits.argmax(-1)
    top2 = np.sort(logits, axis=-1)[..., -2:]
    near = (top2[..., 1] - top2[..., 0]) <= TOL * np.maximum(1.0, np.abs(top2[..., 1]))
    diff = (am_c != am_r) & ~near
    if diff.any():
        b, k = np.argwhere(diff)[0]
        fails.append(f"argmax differs at {int(diff.sum())} slots, first block {b} slot {k}: C++ "
                     f"{am_c[b, k]} vs reference {am_r[b, k]} "
                     f"(logits {logits[b, k, am_c[b, k]]:.8g}"
                     f" vs {logits[b, k, am_r[b, k]]:.8g})")
    am_used = np.where(near, am_c, am_r)
    acc, tau, slot = dflash_ref.metrics(am_used, labels, counted)
    if np.float32(acc) != cpp["accuracy"][0]:
        fails.append(f"accuracy: C++ {cpp['accuracy'][0]!r} vs reference {acc!r}")
    if np.float32(tau) != cpp["tau"][0]:
        fails.append(f"tau: C++ {cpp['tau'][0]!r} vs reference {tau!r}")
    if not np.array_equal(slot.astype(np.float32), cpp["slot_accuracy"], equal_nan=True):
        fails.append(f"slot_accuracy: C++ {cpp['slot_accuracy'].tolist()} vs reference "
                     f"{slot.tolist()}")
    n_docs = len(prob[7]) - 1
    summary = (f"config {idx:2d}: H {cfg['hidden_size']:2d} NH/NKV {cfg['num_attention_heads']}/"
               f"{cfg['num_key_value_heads']} D {cfg['head_dim']:2d} K {cfg['block_size']:2d} "
               f"L {cfg['num_hidden_layers']} taps {len(cfg['dflash_config']['target_layer_ids'])} "
               f"V {cfg['vocab_size']} gamma {prob[9]:g} docs {n_docs} T {len(prob[5])} "
               f"blocks {len(prob[8])} | loss {loss:.6f} rel {loss_err:.1e} | worst grad rel "
               f"{worst:.1e} ({worst_name}) | acc {acc:.4f} tau {tau:.4f} near-ties "
               f"{int(near.sum())} | {'ok' if not fails else 'FAIL'}")
    return summary, ("\n  ".join(fails) if fails else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dflash", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--shared", required=True)
    args = ap.parse_args()
    t0 = time.time()
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for idx, spec in enumerate(CONFIGS):
            prob = make_problem(idx, spec)
            ref_fn = reference_fn(prob)
            prob = plant_predictions(prob, ref_fn, np.random.default_rng(SEED - idx))
            cpp = run_cpp(args.dflash, tmp, idx, prob)
            ref = run_ref(prob, ref_fn, cross_check=idx == 0)
            summary, fail = compare(idx, prob, cpp, ref)
            print(summary, flush=True)
            if fail:
                failures.append(f"config {idx}:\n  {fail}")
    print(f"checked {len(CONFIGS)} configurations against dflash_ref.py (float64) in "
          f"{time.time() - t0:.1f} s: loss and gradients within {TOL:g} relative, argmax, "
          f"accuracy, "
          f"tau and per-slot accuracy exactly")
    if failures:
        print(f"\nFAILED: {len(failures)} of {len(CONFIGS)} configurations. First failure:\n"
              f"{failures[0]}", flush=True)
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()
