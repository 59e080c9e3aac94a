#!/usr/bin/env python3
"""Writes tests/fixtures/byte-tokenizer/tokenizer.json: a byte-level BPE tokenizer without merges
(ids 0..255 are the bytes, in GPT-2's byte-to-unicode spelling) plus the ChatML special tokens
<|endoftext|> 256, <|im_start|> 257, <|im_end|> 258. It pairs with the 512-row embeddings of the
random golden checkpoints (tests/fixtures/models) so that `dflash train` can run on them: ids
259..511 are embedding rows the tokenizer never produces (mask token candidates).

    python3 tools/make_byte_tokenizer.py --out tests/fixtures/byte-tokenizer

Needs the `tokenizers` package (tests/reference/requirements.txt).
"""
import argparse
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def byte_to_unicode():
    """GPT-2's reversible byte -> printable character map (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    u = byte_to_unicode()
    vocab = {u[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert tok.token_to_id("<|im_end|>") == 258, tok.token_to_id("<|im_end|>")
    text = "<|im_start|>user\nHi, café!<|im_end|>\n"
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text, tok.decode(ids)
    os.makedirs(args.out, exist_ok=True)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    print(f"{args.out}/tokenizer.json: {tok.get_vocab_size()} tokens; {text!r} -> {ids}")


if __name__ == "__main__":
    main()
