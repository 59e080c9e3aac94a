"""Reference DFlash drafter and training objective in JAX, written from DESIGN.md §1.

Used by the differential tests (tests/reference/*_test.py) to check the C++ drafter: its autodiff
gives the gradients. Everything is float32 unless `jax_enable_x64` is set by the caller.

Layout: one packed row of T context tokens with document offsets; N blocks of K slots given by
explicit anchors (pos, doc). Block b's queries see the context rows of its document strictly before
its anchor, and the K keys of its own block (bidirectional).
"""
import json
import struct

import jax
import jax.numpy as jnp
import numpy as np


def read_safetensors(path):
    """Minimal safetensors reader (numpy), bf16 widened to float32."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        buf = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = buf[b:e]
        dt = info["dtype"]
        if dt == "BF16":
            a = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            a = a.view(np.float32)
        else:
            a = np.frombuffer(raw, dtype={"F32": np.float32, "I64": np.int64, "I32": np.int32,
                                          "U8": np.uint8, "BOOL": np.bool_, "F64": np.float64}[dt])
        out[name] = a.reshape(info["shape"]).copy()
    return out


def rms_norm(x, w, eps):
    var = jnp.mean(x * x, axis=-1, keepdims=True)
    return w * (x * jax.lax.rsqrt(var + eps))


def rope_cos_sin(pos, D, theta):
    inv = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    ang = np.asarray(pos, dtype=np.float64)[:, None] * inv[None, :]
    emb = np.concatenate([ang, ang], axis=-1)
    dt = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    return jnp.asarray(np.cos(emb), dt), jnp.asarray(np.sin(emb), dt)


def apply_rope(x, cos, sin):
    # x [R, heads, D]; HF rotate_half layout.
    D = x.shape[-1]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    rot = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def drafter_logits(params, cfg, features, tokens, doc_offsets, anchors, embed, lm_head):
    """Logits [N, K, V] of the blocks at `anchors` (list of (pos, doc)).

    params: dict of drafter weights (export names); features [T, n_taps*H]; tokens [T] int;
    doc_offsets list of ints; embed [V, H]; lm_head [V, H].
    """
    H, NH, NKV, D = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    K, eps, theta = cfg["block_size"], cfg["rms_norm_eps"], cfg["rope_theta"]
    mask_id = cfg["mask_token_id"]
    L = cfg["num_hidden_layers"]
    ctx = rms_norm(features @ params["fc.weight"].T, params["hidden_norm.weight"], eps)
    outs = []
    for (a, d) in anchors:
        s = doc_offsets[d]
        blk_tok = np.array([tokens[a]] + [mask_id] * (K - 1))
        h = embed[blk_tok]
        c = ctx[s:a]
        pos_c = np.arange(0, a - s)
        pos_b = np.arange(a - s, a - s + K)
        cos_c, sin_c = rope_cos_sin(pos_c, D, theta)
        cos_b, sin_b = rope_cos_sin(pos_b, D, theta)
        for i in range(L):
            p = lambda n: params[f"layers.{i}.{n}"]
            hn = rms_norm(h, p("input_layernorm.weight"), eps)
            q = (hn @ p("self_attn.q_proj.weight").T).reshape(K, NH, D)
            q = rms_norm(q, p("self_attn.q_norm.weight"), eps)
            q = apply_rope(q, cos_b, sin_b)
            kv_in = jnp.concatenate([c, hn], axis=0)
            k = (kv_in @ p("self_attn.k_proj.weight").T).reshape(-1, NKV, D)
            k = rms_norm(k, p("self_attn.k_norm.weight"), eps)
            cos_k = jnp.concatenate([cos_c, cos_b], axis=0)
            sin_k = jnp.concatenate([sin_c, sin_b], axis=0)
            k = apply_rope(k, cos_k, sin_k)
            v = (kv_in @ p("self_attn.v_proj.weight").T).reshape(-1, NKV, D)
            rep = NH // NKV
            k = jnp.repeat(k, rep, axis=1)
            v = jnp.repeat(v, rep, axis=1)
            sc = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(D)
            pr = jax.nn.softmax(sc, axis=-1)
            o = jnp.einsum("hqk,khd->qhd", pr, v).reshape(K, NH * D)
            h = h + o @ p("self_attn.o_proj.weight").T
            hn = rms_norm(h, p("post_attention_layernorm.weight"), eps)
            g = hn @ p("mlp.gate_proj.weight").T
            u = hn @ p("mlp.up_proj.weight").T
            h = h + (jax.nn.silu(g) * u) @ p("mlp.down_proj.weight").T
        hf = rms_norm(h, params["norm.weight"], eps)
        outs.append(hf @ lm_head.T)
    return jnp.stack(outs)


def drafter_logits_packed(params, cfg, features, tokens, doc_offsets, anchors, embed, lm_head):
    """The same logits [N, K, V] as drafter_logits, computed for all blocks at once with fixed
    shapes (the visibility rule as a mask over all T context rows instead of a slice), so that
    it jit-compiles once per problem. Context row q has position q - start(doc of q); block b
    sees rows start(doc_b) <= q < anchor_b and its own K rows.
    """
    NH, NKV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    K, eps, theta = cfg["block_size"], cfg["rms_norm_eps"], cfg["rope_theta"]
    mask_id, L = cfg["mask_token_id"], cfg["num_hidden_layers"]
    T, N, rep = features.shape[0], len(anchors), NH // NKV
    tokens = np.asarray(tokens)
    pos_rel = np.zeros(T, np.int64)
    for d in range(len(doc_offsets) - 1):
        s, e = doc_offsets[d], doc_offsets[d + 1]
        pos_rel[s:e] = np.arange(e - s)
    A = np.array([a for a, _ in anchors], np.int64)
    S = np.array([doc_offsets[d] for _, d in anchors], np.int64)
    blk_tok = np.full((N, K), mask_id, np.int64)
    blk_tok[:, 0] = tokens[A]
    pos_b = (A - S)[:, None] + np.arange(K)[None, :]
    vis = (np.arange(T)[None, :] >= S[:, None]) & (np.arange(T)[None, :] < A[:, None])  # [N, T]
    cos_c, sin_c = rope_cos_sin(pos_rel, D, theta)
    cos_b, sin_b = rope_cos_sin(pos_b.reshape(-1), D, theta)

    def rope_blk(x):  # [N, K, heads, D]
        return apply_rope(x.reshape(N * K, x.shape[2], D), cos_b, sin_b).reshape(x.shape)

    ctx = rms_norm(features @ params["fc.weight"].T, params["hidden_norm.weight"], eps)
    h = embed[blk_tok]
    for i in range(L):
        p = lambda n: params[f"layers.{i}.{n}"]
        hn = rms_norm(h, p("input_layernorm.weight"), eps)
        q = rope_blk(rms_norm((hn @ p("self_attn.q_proj.weight").T).reshape(N, K, NH, D),
                              p("self_attn.q_norm.weight"), eps))
        kc = apply_rope(rms_norm((ctx @ p("self_attn.k_proj.weight").T).reshape(T, NKV, D),
                                 p("self_attn.k_norm.weight"), eps), cos_c, sin_c)
        kb = rope_blk(rms_norm((hn @ p("self_attn.k_proj.weight").T).reshape(N, K, NKV, D),
                               p("self_attn.k_norm.weight"), eps))
        vc = (ctx @ p("self_attn.v_proj.weight").T).reshape(T, NKV, D)
        vb = (hn @ p("self_attn.v_proj.weight").T).reshape(N, K, NKV, D)
        kc, vc = jnp.repeat(kc, rep, axis=1), jnp.repeat(vc, rep, axis=1)
        kb, vb = jnp.repeat(kb, rep, axis=2), jnp.repeat(vb, rep, axis=2)
        sc_c = jnp.einsum("nqhd,thd->nhqt", q, kc) / np.sqrt(D)
        sc_c = jnp.where(vis[:, None, None, :], sc_c, -jnp.inf)
        sc_b = jnp.einsum("nqhd,nkhd->nhqk", q, kb) / np.sqrt(D)
        pr = jax.nn.softmax(jnp.concatenate([sc_c, sc_b], axis=-1), axis=-1)
        o = (jnp.einsum("nhqt,thd->nqhd", pr[..., :T], vc) +
             jnp.einsum("nhqk,nkhd->nqhd", pr[..., T:], vb)).reshape(N, K, NH * D)
        h = h + o @ p("self_attn.o_proj.weight").T
        hn = rms_norm(h, p("post_attention_layernorm.weight"), eps)
        g = hn @ p("mlp.gate_proj.weight").T
        u = hn @ p("mlp.up_proj.weight").T
        h = h + (jax.nn.silu(g) * u) @ p("mlp.down_proj.weight").T
    return rms_norm(h, params["norm.weight"], eps) @ lm_head.T


def targets(tokens, loss_mask, doc_offsets, anchors, K, gamma):
    """labels [N,K] (-1 invalid), weights [N,K], counted [N,K] (DESIGN.md §1)."""
    N = len(anchors)
    labels = -np.ones((N, K), np.int64)
    w = np.zeros((N, K), np.float32)
    cnt = np.zeros((N, K), np.float32)
    for b, (a, d) in enumerate(anchors):
        e = doc_offsets[d + 1]
        for k in range(K):
            p = a + k
            if p >= e:
                continue
            labels[b, k] = tokens[p]
            if k >= 1 and loss_mask[p]:
                w[b, k] = np.exp(-(k - 1) / gamma) if gamma > 0 else 1.0
                cnt[b, k] = 1.0
    return labels, w, cnt


def loss_fn(params, cfg, features, tokens, loss_mask, doc_offsets, anchors, embed, lm_head, gamma,
            logits_fn=None):
    """(loss, (argmax [N,K], ce [N,K])) with loss = Σ w·CE / Σ w. `logits_fn`: drafter_logits
    (default) or drafter_logits_packed (same arguments)."""
    K = cfg["block_size"]
    logits = (logits_fn or drafter_logits)(params, cfg, features, tokens, doc_offsets, anchors,
                                           embed, lm_head)
    labels, w, _ = targets(tokens, loss_mask, doc_offsets, anchors, K, gamma)
    lse = jax.scipy.special.logsumexp(logits, axis=-1)
    safe = np.maximum(labels, 0)
    picked = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    ce = lse - picked
    loss = jnp.sum(w * ce) / jnp.sum(w)
    return loss, (jnp.argmax(logits, axis=-1), ce)


def metrics(argmax, labels, counted):
    """(accuracy, tau, slot_accuracy [K]) of DESIGN.md §1 from argmax/labels/counted [N,K].

    accuracy: correct supervised slots / supervised slots; tau: mean over blocks of 1 + the number
    of leading slots k >= 1 that are supervised and correct; slot_accuracy[k]: NaN where slot k was
    never supervised (always for k = 0).
    """
    argmax = np.asarray(argmax)
    ok = (counted > 0) & (argmax == labels)
    n = counted.sum()
    acc = ok.sum() / n if n else 0.0
    N, K = labels.shape
    taus = []
    for b in range(N):
        a = 0
        for k in range(1, K):
            if not ok[b, k]:
                break
            a += 1
        taus.append(1 + a)
    tau = float(np.mean(taus)) if N else 0.0
    cnt_k = counted.sum(axis=0)
    slot = np.where(cnt_k > 0, ok.sum(axis=0) / np.maximum(cnt_k, 1), np.nan)
    slot[0] = np.nan
    return float(acc), tau, slot
