#!/usr/bin/env python3
"""Checks that a chapter 09 checkpoint is GPT-2 as Hugging Face reads it.

    python3 chapters/09_gpt/hf_check.py CKPT [--text FILE] [--sequences N] [--offset K]
                                             [--validation] [--expect LOSS | --expect-json FILE]
                                             [--tolerance REL] [--require-hf]

It reads CKPT/config.json and CKPT/model.safetensors, or the files model.safetensors.index.json
names (one per pipeline stage: ch09_gpt writes a sharded checkpoint), parsed here with numpy
alone (an 8-byte little-endian header length, a JSON header of dtype, shape and data_offsets,
then F32 data), and runs GPT-2's forward pass, written out below in float64 independently of the C++ code:
wte + wpe, then per block x + c_proj(attention(ln_1(x))) and x + c_proj(gelu_new(c_fc(ln_2(x)))),
ln_f, logits = x wte^T (the head tied to wte). The loss is the mean cross-entropy of each next
byte over N sequences of T = n_positions bytes, back to back from byte K of the text
(inputs bytes[s:s+T], targets bytes[s+1:s+T+1]). ch09_gpt's validation loss is this one with
its --data as the text, K = len(text) * 9 // 10 (where its validation text starts) and N = 16.

If torch and transformers import, GPT2LMHeadModel.from_pretrained(CKPT) computes logits on the
same inputs, and the same cross-entropy is taken of them: the two losses must agree to 1e-4
(relative), and the checkpoint must leave no weight missing but the causal-mask buffers and
the tied lm_head. Both read the same file, so they agree on a checkpoint whose c_attn columns
are in the wrong order too: --expect (the validation loss ch09_gpt printed) catches that.

Exit status: 0 checked; 1 a disagreement, a missing weight, or a loss off --expect; 2 bad
usage, files that are not a checkpoint (a Mixture-of-Experts one of ch09_gpt --experts among
them: not GPT-2), or too little text; 77 --require-hf without them.
"""
import argparse
import json
import math
import os
import re
import sys

import numpy as np

AGREE = 1e-4  # relative: numpy's float64 loss against Hugging Face's float32 one
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TEXT = os.path.join(ROOT, "chapters", "09_gpt", "text", "chapters.txt")  # ch09_gpt's


def fail(message, status=1):
    print(f"hf_check: {message}", file=sys.stderr)
    sys.exit(status)


def read_safetensors(path):
    """{name: float32 array} of a safetensors file of F32 tensors."""
    with open(path, "rb") as f:
        raw = f.read()
    bad = lambda why: fail(f"{path} is not a safetensors file of float32 tensors: {why}", 2)
    if len(raw) < 8:
        bad("shorter than its 8-byte header length")
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8:
        bad("its header is longer than the file")
    try:
        header = json.loads(raw[8:8 + n])
    except ValueError:
        bad("its header is not JSON")
    data, out = raw[8 + n:], {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") != "F32":
            bad(f"{name} is not F32: {entry}")
        try:
            shape, (begin, end) = [int(d) for d in entry["shape"]], entry["data_offsets"]
            count = math.prod(shape)
        except (KeyError, TypeError, ValueError):
            bad(f"{name}'s entry lacks a shape or data_offsets")
        if not 0 <= begin <= end <= len(data) or end - begin != 4 * count:
            bad(f"{name}'s shape {shape} and byte range [{begin}, {end}) do not fit the file")
        out[name] = np.frombuffer(data, dtype="<f4", count=count, offset=begin).reshape(shape)
    return out


def layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def gelu_new(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def numpy_logits(weights, config, ids):
    """GPT-2's logits [N, T, V] for the byte ids [N, T], in float64."""
    def w(name):
        if name not in weights:
            fail(f"the checkpoint has no {name}")
        return weights[name].astype(np.float64)
    C, H, eps = config["n_embd"], config["n_head"], config["layer_norm_epsilon"]
    N, T = ids.shape
    D = C // H
    x = w("transformer.wte.weight")[ids] + w("transformer.wpe.weight")[:T]
    future = np.triu(np.ones((T, T), dtype=bool), 1)  # key after query: masked
    for b in range(config["n_layer"]):
        p = f"transformer.h.{b}."
        h = layer_norm(x, w(p + "ln_1.weight"), w(p + "ln_1.bias"), eps)
        qkv = h @ w(p + "attn.c_attn.weight") + w(p + "attn.c_attn.bias")  # [q | k | v]
        q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(N, T, H, D).transpose(0, 2, 1, 3)
                   for i in range(3))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(D)
        scores[..., future] = -np.inf
        att = np.exp(scores - scores.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(N, T, C)
        x = x + y @ w(p + "attn.c_proj.weight") + w(p + "attn.c_proj.bias")
        h = layer_norm(x, w(p + "ln_2.weight"), w(p + "ln_2.bias"), eps)
        h = gelu_new(h @ w(p + "mlp.c_fc.weight") + w(p + "mlp.c_fc.bias"))
        x = x + h @ w(p + "mlp.c_proj.weight") + w(p + "mlp.c_proj.bias")
    x = layer_norm(x, w("transformer.ln_f.weight"), w("transformer.ln_f.bias"), eps)
    return x @ w("transformer.wte.weight").T


def cross_entropy(logits, targets):
    """Mean of -log softmax(logits)[target] over every position, in float64."""
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-np.take_along_axis(log_p, targets[..., None], -1).mean())


def hf_logits(ckpt, inputs):
    """Hugging Face's logits, or None when torch or transformers does not import."""
    try:
        import torch
        from transformers import GPT2LMHeadModel
    except ImportError as e:
        print(f"transformers/torch: not installed ({e}); only the numpy forward was checked")
        return None
    model, info = GPT2LMHeadModel.from_pretrained(ckpt, output_loading_info=True)
    model = model.float().eval()
    allowed = re.compile(r"(^lm_head\.weight$)|(\.attn\.(masked_)?bias$)")
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(kind):
            print(f"transformers: {kind}: {sorted(map(str, info[kind]))}")
    bad = [k for k in info.get("missing_keys", []) if not allowed.search(k)]
    bad += [str(k) for k in info.get("mismatched_keys", [])]
    if bad:
        fail(f"transformers left weights missing or of the wrong shape: {sorted(bad)}")
    if model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr():
        fail("transformers did not tie lm_head.weight to transformer.wte.weight")
    with torch.no_grad():
        return model(torch.from_numpy(inputs.astype(np.int64))).logits.double().numpy()


def read_checkpoint(ckpt):
    """{name: float32 array} of CKPT/model.safetensors, or of the files that
    CKPT/model.safetensors.index.json names (a sharded checkpoint, as ch09_gpt writes one
    file per pipeline stage)."""
    index = os.path.join(ckpt, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return read_safetensors(os.path.join(ckpt, "model.safetensors"))
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        fail(f"{index} is not an index of safetensors files (no weight_map)", 2)
    weights = {}
    for name in files:
        if os.path.basename(name) != name:
            fail(f"{index} names {name!r}, not a file of the folder", 2)
        weights.update(read_safetensors(os.path.join(ckpt, name)))
    missing = sorted(set(weight_map) - set(weights))
    if missing:
        fail(f"{index} names {missing[0]}, which none of its files holds", 2)
    return weights


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--text", default=DEFAULT_TEXT,
                    help="the bytes to score (default: ch09_gpt's --data, chapters/09_gpt/text/chapters.txt)")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--validation", action="store_true",
                    help="score ch09_gpt's validation sequences: 16 from byte len(text)*9//10")
    ap.add_argument("--expect", type=float)
    ap.add_argument("--expect-json", metavar="FILE",
                    help="--expect the validation_loss of ch09_gpt's --json output in FILE")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--require-hf", action="store_true",
                    help="exit 77 without torch and transformers")
    a = ap.parse_args()
    if a.expect_json:
        with open(a.expect_json) as f:
            a.expect = json.load(f)["validation_loss"]
    has = lambda f: os.path.isfile(os.path.join(a.checkpoint, f))
    if not has("config.json") or not (has("model.safetensors") or
                                      has("model.safetensors.index.json")):
        fail(f"{a.checkpoint}: no config.json and model.safetensors (or its index): "
             "not a checkpoint of chapter 09", 2)
    if not os.path.isfile(a.text):
        fail(f"--text {a.text}: cannot read it (give --text FILE)", 2)
    with open(os.path.join(a.checkpoint, "config.json")) as f:
        config = json.load(f)
    if config.get("num_local_experts", 0):  # ch09_gpt --experts: not a GPT-2
        fail(f"{a.checkpoint}: a Mixture-of-Experts model ({config['num_local_experts']} experts, "
             f"model_type {config.get('model_type')}): GPT-2's dense MLPs cannot take it, here or "
             "in GPT2LMHeadModel; ch09_gpt --load reads it", 2)
    for key, want in (("activation_function", "gelu_new"), ("scale_attn_weights", True),
                      ("scale_attn_by_inverse_layer_idx", False)):  # what the forward does
        if config.get(key, want) != want:
            fail(f"config.json: {key} is {config[key]}; this check computes {want} only", 2)
    config.setdefault("layer_norm_epsilon", 1e-5)
    T = config["n_positions"]
    with open(a.text, "rb") as f:
        text = np.frombuffer(f.read(), dtype=np.uint8)
    if a.validation:
        a.offset, a.sequences = len(text) * 9 // 10, 16
    need = a.offset + a.sequences * T + 1
    if a.sequences < 1 or a.offset < 0 or need > len(text):
        fail(f"--text {a.text}: {len(text)} bytes; {a.sequences} sequences of {T} from byte "
             f"{a.offset} need {need}", 2)
    starts = a.offset + T * np.arange(a.sequences)
    inputs = np.stack([text[s:s + T] for s in starts]).astype(np.int64)
    targets = np.stack([text[s + 1:s + T + 1] for s in starts]).astype(np.int64)
    if inputs.max() >= config["vocab_size"]:
        fail(f"the text has byte {inputs.max()}, the vocabulary {config['vocab_size']} tokens", 2)

    print(f"{a.checkpoint}: {config['n_layer']} layers, {config['n_embd']} channels, "
          f"{config['n_head']} heads, T {T}; {a.sequences} sequences from byte {a.offset} "
          f"of {a.text}")
    weights = read_checkpoint(a.checkpoint)
    loss = cross_entropy(numpy_logits(weights, config, inputs), targets)
    print(f"numpy loss        {loss:.6f}")
    losses = [loss]
    logits = hf_logits(a.checkpoint, inputs)
    if logits is None and a.require_hf:
        fail("--require-hf: torch and transformers are not installed", 77)
    if logits is not None:
        hf = cross_entropy(logits, targets)
        diff = abs(hf - loss) / abs(loss)
        print(f"transformers loss {hf:.6f}  (relative difference {diff:.2e})")
        if diff > AGREE:
            fail(f"numpy's loss {loss:.6f} and transformers' {hf:.6f} differ by {diff:.2e} "
                 f"> {AGREE:g}")
        losses.append(hf)
    if a.expect is not None:
        for name, value in zip(("numpy", "transformers"), losses):
            if abs(value - a.expect) > a.tolerance * abs(a.expect):
                fail(f"{name}'s loss {value:.6f} is not --expect {a.expect} within {a.tolerance:g}")
        print(f"matches --expect {a.expect} within {a.tolerance:g}")


if __name__ == "__main__":
    main()
