"""Differential test: our tokenizer against HF `tokenizers` on seeded random strings.

For both tokenizers (assets/tiny-qwen3 and the real Qwen3 tokenizer.json.xz) we generate N random
strings (seed SEED, N per tokenizer below) mixing scripts (Latin with precomposed and decomposed
accents, Greek, Cyrillic, Arabic, Hebrew, Devanagari, Thai, CJK, kana, Hangul syllables and
jamo), digit runs, whitespace runs (spaces, \\t, \\r\\n, NBSP, U+2000.., U+3000, U+0085, U+2028),
emoji (skin tones, ZWJ sequences, flags, variation selectors), combining marks, contractions with
case variants (incl. U+017F and U+212A, which case-fold to s and k), special-token look-alikes
("<|im_start", "<|endoftext|>x", "|im_end|>") and the real special tokens, plus long runs.
All are encoded by HF (add_special_tokens=False) and by `dflash tokenize --jsonl --offsets` in one
process call; ids must be identical. We also check, against HF, the token offsets (converted from
our byte ranges to character indices) for inputs the normalizer leaves unchanged, and decode(ids).
On the first difference the test prints the string (repr) and both results and fails.
"""
import argparse
import json
import lzma
import os
import random
import subprocess
import sys
import tempfile
import unicodedata

from tokenizers import Tokenizer

SEED = 20240611
N_PER_TOKENIZER = 2500

R = lambda a, b: [chr(c) for c in range(a, b + 1)]
LATIN = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
ACCENTED = list("éèêëàâäôöûüçñÅåøæœßÉÀÇÑ") + ["e\u0301", "a\u0300", "o\u0308", "A\u030a",
                                                "\u212b", "n\u0303", "u\u0308\u0301"]
GREEK = R(0x3B1, 0x3C9) + R(0x391, 0x3A9)
CYRILLIC = R(0x430, 0x44F) + R(0x410, 0x42F)
ARABIC = R(0x627, 0x64A) + ["\u064E", "\u0651"]
HEBREW = R(0x5D0, 0x5EA)
DEVANAGARI = R(0x915, 0x939) + ["\u093E", "\u093F", "\u0940", "\u094D", "\u0902"]
THAI = R(0xE01, 0xE2E) + ["\u0E31", "\u0E34", "\u0E48"]
CJK = R(0x4E00, 0x4E80) + list("中文字世界你好，。！？「」")
KANA = R(0x3041, 0x3093) + R(0x30A1, 0x30F3)
HANGUL = R(0xAC00, 0xAC40) + list("안녕하세요") + ["\u1100\u1161", "\u1100\u1161\u11A8", "\u11A8"]
DIGITS = list("0123456789") + ["٣", "५", "１", "²", "½", "Ⅻ"]
PUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + list("…—–«»“”‘’•·§¶†")
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\n\n", " \n", "\u00a0", "\u2003", "\u3000", "\u0085",
          "\u2028", "\u200b", "\u180e", "\x0b", "\x0c", "\r"]
EMOJI = ["😀", "👍", "👍🏽", "🎉", "❤️", "👨‍👩‍👧‍👦", "🧑🏿‍💻", "🏳️‍🌈", "🇺🇸", "🇯🇵", "✨", "🔥", "☃", "\ufe0f"]
COMBINING = R(0x300, 0x36F)[:40] + ["\u20dd", "\u0489"]
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'LL", "'D",
                "'ſ", "'\u212a", "n't", "'x"]
SPECIAL_LIKE = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start", "im_start|>",
                "<|endoftext|>x", "x<|endoftext|>", "|im_end|>", "<|im_end", "<|", "|>", "<think>",
                "</think>", "<tool_call>", "<|im_start|><|im_end|>", "< |im_start| >",
                "<|IM_START|>", "<|object_ref_start|>", "<|fim_prefix|>"]
WORDS = ["the", "The", "hello", "world", "tokenizer", "DFlash", "speculative", "don't", "I'm",
         "naïve", "café", "résumé", "Straße", "москва", "東京", "Ελλάδα", "x", "ab", "=", "=="]
POOLS = [(LATIN, 8), (ACCENTED, 2), (GREEK, 1), (CYRILLIC, 1), (ARABIC, 1), (HEBREW, 1),
         (DEVANAGARI, 1), (THAI, 1), (CJK, 2), (KANA, 1), (HANGUL, 1), (DIGITS, 3), (PUNCT, 3),
         (SPACES, 4), (EMOJI, 2), (COMBINING, 1), (CONTRACTIONS, 2), (SPECIAL_LIKE, 2),
         (WORDS, 6)]


def random_string(rng):
    kind = rng.random()
    if kind < 0.03:  # long runs
        unit = rng.choice(["a", " ", "ab", "\n", "1", "é", "😀", "-", "\t ", "aa "])
        return unit * rng.randint(50, 400)
    n = rng.randint(0, 40)
    pools, weights = zip(*POOLS)
    out = []
    for _ in range(n):
        pool = rng.choices(pools, weights)[0]
        piece = rng.choice(pool)
        if pool is LATIN or pool is CJK or pool is DIGITS:
            piece = "".join(rng.choice(pool) for _ in range(rng.randint(1, 8)))
        out.append(piece)
    return "".join(out)


def char_offsets(text, byte_offsets):
    """Byte ranges of UTF-8 `text` -> character index ranges (as HF reports in Python)."""
    b2c = {}
    pos = 0
    for i, ch in enumerate(text):
        b2c[pos] = i
        pos += len(ch.encode("utf-8"))
    b2c[pos] = len(text)
    return [(b2c[b], b2c[e]) for b, e in byte_offsets]


def check(dflash, model_dir, name, n, rng):
    hf = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    texts = [random_string(rng) for _ in range(n)]
    hf_enc = hf.encode_batch(texts, add_special_tokens=False)
    inp = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode("utf-8")
    r = subprocess.run([dflash, "tokenize", "--model", model_dir, "--jsonl", "--offsets"],
                       input=inp, capture_output=True)
    if r.returncode != 0:
        sys.exit(f"FAIL [{name}]: dflash tokenize exited {r.returncode}: {r.stderr.decode()}")
    ours = [json.loads(l) for l in r.stdout.decode("utf-8").split("\n")[:-1]]
    assert len(ours) == n, (len(ours), n)
    n_offsets = 0
    for t, h, o in zip(texts, hf_enc, ours):
        if h.ids != o["ids"]:
            print(f"[{name}] first differing string: {t!r}\n  HF:   {h.ids}\n  ours: {o['ids']}\n"
                  f"  HF tokens:   {h.tokens}")
            sys.exit(f"FAIL [{name}]: ids differ")
        if (hf.normalizer.normalize_str(t) if hf.normalizer else t) == t:
            ho = [tuple(x) for x in h.offsets]
            oo = char_offsets(t, o["offsets"])
            if ho != oo:
                print(f"[{name}] offsets differ for {t!r}\n  HF:   {ho}\n  ours: {oo}\n"
                      f"  tokens: {h.tokens}")
                sys.exit(f"FAIL [{name}]: offsets differ")
            n_offsets += 1
    # decode(ids) against HF decode; decode(encode(s)) == normalized s.
    inp = "".join(json.dumps({"ids": h.ids}) + "\n" for h in hf_enc).encode("utf-8")
    r = subprocess.run([dflash, "tokenize", "--model", model_dir, "--jsonl", "--decode"],
                       input=inp, capture_output=True)
    if r.returncode != 0:
        sys.exit(f"FAIL [{name}]: dflash tokenize --decode exited {r.returncode}: {r.stderr.decode()}")
    dec = [json.loads(l)["text"] for l in r.stdout.decode("utf-8").split("\n")[:-1]]
    hf_dec = hf.decode_batch([h.ids for h in hf_enc], skip_special_tokens=False)
    for t, h, o in zip(texts, hf_dec, dec):
        if h != o:
            sys.exit(f"FAIL [{name}]: decode differs for {t!r}: HF {h!r} ours {o!r}")
        if (hf.normalizer.normalize_str(t) if hf.normalizer else t) != o and \
                name in ("tiny-qwen3", "qwen3"):
            sys.exit(f"FAIL [{name}]: decode(encode(s)) != NFC(s) for {t!r}: {o!r}")
    n_tok = sum(len(h.ids) for h in hf_enc)
    print(f"[{name}] {n} random strings ({n_tok} tokens): ids identical to HF; offsets identical on "
          f"{n_offsets} inputs the normalizer leaves unchanged; decode identical and round-trips")


def variants(base_dir, out_dir):
    """Tokenizers derived from the tiny one that exercise the other supported pieces: added-token
    flags (lstrip, rstrip, single_word, normalized, non-special), NFKC in a normalizer Sequence,
    ByteLevel with its own GPT-2 regex and add_prefix_space, and the other Split behaviours."""
    base = json.load(open(os.path.join(base_dir, "tokenizer.json"), encoding="utf-8"))
    added = [
        {"id": 8000, "content": "<mask>", "single_word": False, "lstrip": True, "rstrip": True,
         "normalized": False, "special": False},
        {"id": 8001, "content": "ony", "single_word": True, "lstrip": False, "rstrip": False,
         "normalized": False, "special": False},
        {"id": 8002, "content": "ﬁx", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": True, "special": False},
        {"id": 8003, "content": "<|im_start|>x", "single_word": False, "lstrip": False,
         "rstrip": True, "normalized": False, "special": True},
    ]
    bl = lambda prefix, regex: {"type": "ByteLevel", "add_prefix_space": prefix,
                                "trim_offsets": False, "use_regex": regex}
    split = lambda pat, behavior, invert=False: {"type": "Split", "pattern": pat,
                                                 "behavior": behavior, "invert": invert}
    specs = {
        "flags+nfkc+gpt2": ({"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "NFC"}]},
                            bl(True, True)),
        "merged-with-next": (None, {"type": "Sequence", "pretokenizers": [
            split({"String": " "}, "MergedWithNext"), bl(False, False)]}),
        "merged-with-prev+removed": ({"type": "NFD"}, {"type": "Sequence", "pretokenizers": [
            split({"Regex": "\\s+"}, "MergedWithPrevious"),
            split({"Regex": "[,;]"}, "Removed"), bl(False, True)]}),
        "contiguous+invert": (None, {"type": "Sequence", "pretokenizers": [
            split({"Regex": "\\p{N}"}, "Contiguous"),
            split({"Regex": "[^\\s]+"}, "Isolated", True), bl(True, False)]}),
    }
    out = []
    for name, (norm, pre) in specs.items():
        j = dict(base)
        j["added_tokens"] = base["added_tokens"] + added
        j["normalizer"] = norm
        j["pre_tokenizer"] = pre
        d = os.path.join(out_dir, name)
        os.makedirs(d)
        json.dump(j, open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8"))
        out.append((name, d))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dflash", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--n", type=int, default=N_PER_TOKENIZER)
    ap.add_argument("--seed", type=int, default=SEED)
    a = ap.parse_args()
    print(f"seed {a.seed}, {a.n} strings per tokenizer")
    rng = random.Random(a.seed)
    check(a.dflash, os.path.join(a.source, "assets", "tiny-qwen3"), "tiny-qwen3", a.n, rng)
    with tempfile.TemporaryDirectory() as tmp:
        with lzma.open(os.path.join(a.shared, "fixtures", "qwen3-tokenizer", "tokenizer.json.xz")) as f, \
                open(os.path.join(tmp, "tokenizer.json"), "wb") as g:
            g.write(f.read())
        check(a.dflash, tmp, "qwen3", a.n, rng)
    SPECIAL_LIKE.extend(["<mask>", " <mask> ", "\t<mask>\n", "ony", "Anthony", "(ony)", "ﬁx", "fix",
                         "<|im_start|>x  ", "ony_", "_ony"])
    with tempfile.TemporaryDirectory() as tmp:
        for name, d in variants(os.path.join(a.source, "assets", "tiny-qwen3"), tmp):
            check(a.dflash, d, name, a.n // 5, rng)
    print("PASS")


if __name__ == "__main__":
    main()
