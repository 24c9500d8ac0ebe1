#!/usr/bin/env python3
"""A float64 numpy forward of a Llama-architecture GGUF, from the weights that llama.cpp's `gguf`
package dequantizes, checked against the llama.cpp reference that llamacpp_reference.py wrote.

    python3 bench/peers/numpy_reference.py --model .models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --ref bench/reference/smollm2-q4_1

It reads the prompts and llama.cpp's 64 greedy tokens from REF/llamacpp.json and runs, per prompt,
one causal forward over the prompt followed by llama.cpp's first 63 generated tokens. That gives
numpy's logits at every one of the 64 steps along llama.cpp's path, so:
- the first-step logits are compared in full with llama.cpp's (REF/first_logits_llamacpp.f32);
- the first step where numpy's argmax is not llama.cpp's token is where numpy's own greedy
  continuation would part from llama.cpp's (before it the two paths are the same).
Writes REF/first_logits_numpy.f32 (float64 results rounded to f32, same layout) and REF/numpy.json.

Model semantics (llama.cpp's LLM_ARCH_LLAMA): RMSNorm with the GGUF's epsilon, rotary embedding on
adjacent pairs (x[2i], x[2i+1]) with theta = pos * base^(-2i/d) -- the converter permuted the Q and
K rows of the Hugging Face checkpoint for this layout --, grouped-query attention where query head
h reads key/value head h // (n_head / n_head_kv), SwiGLU feed-forward, the output head tied to
token_embd when output.weight is absent.
"""

import os
import sys

# bench/peers also holds scripts that may be named like standard modules: keep this directory off
# the import path, which Python puts first when it runs a script.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import argparse
import json
import re

import numpy as np
import gguf


def dump_json(obj, path):
    """Indented JSON with arrays of numbers kept on one line."""
    text = json.dumps(obj, indent=1, ensure_ascii=False)
    text = re.sub(r"\[[-+0-9.e,\s]*\]", lambda m: re.sub(r"\s+", " ", m.group(0)).replace("[ ", "[").replace(" ]", "]"), text)
    with open(path, "w") as f:
        f.write(text + "\n")


class Model:
    def __init__(self, path):
        r = gguf.GGUFReader(path)
        arch = r.fields["general.architecture"].contents()
        if arch != "llama":
            raise SystemExit(f"architecture {arch!r}: only 'llama' is implemented here")

        def meta(key):
            return r.fields[f"{arch}.{key}"].contents()

        self.n_layer = int(meta("block_count"))
        self.n_embd = int(meta("embedding_length"))
        self.n_head = int(meta("attention.head_count"))
        self.n_head_kv = int(meta("attention.head_count_kv"))
        self.head_dim = self.n_embd // self.n_head
        self.eps = float(meta("attention.layer_norm_rms_epsilon"))
        self.rope_base = float(meta("rope.freq_base"))
        self.w = {}
        for t in r.tensors:
            self.w[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64)
        self.out_w = self.w.get("output.weight", self.w["token_embd.weight"])
        self.types = sorted({(t.name.split(".")[-2], t.tensor_type.name) for t in r.tensors})

    def rmsnorm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):
        # x: [T, heads, head_dim]; adjacent pairs rotated (llama.cpp's "normal" rope).
        d = self.head_dim
        inv = self.rope_base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        ang = pos[:, None].astype(np.float64) * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def forward(self, ids):
        """Logits [T, n_vocab] for every position of one causal sequence."""
        T = len(ids)
        pos = np.arange(T)
        x = self.w["token_embd.weight"][np.asarray(ids)]
        group = self.n_head // self.n_head_kv
        mask = np.triu(np.full((T, T), -np.inf), k=1)
        for i in range(self.n_layer):
            w = lambda n: self.w[f"blk.{i}.{n}.weight"]  # noqa: E731
            h = self.rmsnorm(x, w("attn_norm"))
            q = (h @ w("attn_q").T).reshape(T, self.n_head, self.head_dim)
            k = (h @ w("attn_k").T).reshape(T, self.n_head_kv, self.head_dim)
            v = (h @ w("attn_v").T).reshape(T, self.n_head_kv, self.head_dim)
            q, k = self.rope(q, pos), self.rope(k, pos)
            att = np.empty((T, self.n_head, self.head_dim))
            for hd in range(self.n_head):
                kv = hd // group
                s = q[:, hd] @ k[:, kv].T / np.sqrt(self.head_dim) + mask
                s = np.exp(s - s.max(axis=-1, keepdims=True))
                s /= s.sum(axis=-1, keepdims=True)
                att[:, hd] = s @ v[:, kv]
            x = x + att.reshape(T, self.n_embd) @ w("attn_output").T
            h = self.rmsnorm(x, w("ffn_norm"))
            g = h @ w("ffn_gate").T
            u = h @ w("ffn_up").T
            x = x + (g / (1.0 + np.exp(-g)) * u) @ w("ffn_down").T
        x = self.rmsnorm(x, self.w["output_norm.weight"])
        return x @ self.out_w.T


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--ref", required=True, help="directory holding llamacpp.json and first_logits_llamacpp.f32")
    args = ap.parse_args()

    with open(os.path.join(args.ref, "llamacpp.json")) as f:
        ref = json.load(f)
    n_vocab, prompts = ref["n_vocab"], ref["prompts"]
    lc_first = np.fromfile(os.path.join(args.ref, ref["first_logits_file"]), dtype="<f4").reshape(len(prompts), n_vocab)

    model = Model(args.model)
    np_first = np.zeros((len(prompts), n_vocab), dtype=np.float64)
    out = []
    for p, rec in enumerate(prompts):
        n_prompt = len(rec["prompt_ids"])
        gen = rec["generated_ids"]
        logits = model.forward(rec["prompt_ids"] + gen[:-1])[n_prompt - 1 :]  # [64, n_vocab]
        np_first[p] = logits[0]
        diff = np.abs(logits[0] - lc_first[p].astype(np.float64))
        # At every step, numpy's logits at llama.cpp's top-2 ids against llama.cpp's values.
        t2 = np.asarray(rec["top2_ids"])
        t2_lc = np.asarray(rec["top2_logits"], dtype=np.float64)
        t2_np = np.take_along_axis(logits, t2, axis=1)
        argmax = logits.argmax(axis=1)
        parts = [s for s in range(len(gen)) if argmax[s] != gen[s]]
        first_part = parts[0] if parts else None
        entry = {
            "name": rec["name"],
            "first_step_max_abs_diff": float(diff.max()),
            "first_step_max_abs_diff_id": int(diff.argmax()),
            "first_step_rms_diff": float(np.sqrt(np.mean(diff * diff))),
            "first_step_argmax_equal": bool(argmax[0] == gen[0]),
            "top2_max_abs_diff_all_steps": float(np.abs(t2_np - t2_lc).max()),
            "parts_at_step": first_part,
        }
        if first_part is not None:
            s = first_part
            entry["at_parting"] = {
                "llamacpp_token": gen[s],
                "numpy_token": int(argmax[s]),
                "llamacpp_top2_ids": rec["top2_ids"][s],
                "llamacpp_top2_logits": rec["top2_logits"][s],
                "llamacpp_top2_margin": rec["top2_logits"][s][0] - rec["top2_logits"][s][1],
                "numpy_logits_at_llamacpp_top2": [float(t2_np[s, 0]), float(t2_np[s, 1])],
            }
        out.append(entry)
        print(json.dumps(entry))

    np_first.astype("<f4").tofile(os.path.join(args.ref, "first_logits_numpy.f32"))
    overall = float(max(e["first_step_max_abs_diff"] for e in out))
    dump_json(
        {
            "what": "float64 numpy forward on gguf-dequantized weights vs llama.cpp CPU (llamacpp.json)",
            "gguf_package": getattr(gguf, "__version__", None) or _gguf_version(),
            "numpy": np.__version__,
            "weight_types": [f"{a}:{b}" for a, b in model.types],
            "first_logits_file": "first_logits_numpy.f32",
            "first_logits_layout": f"little-endian f32 (float64 rounded), row-major [{len(prompts)}, {n_vocab}], rows in prompt order",
            "max_abs_first_step_diff_all_prompts": overall,
            "prompts": out,
        },
        os.path.join(args.ref, "numpy.json"),
    )
    print(f"max |numpy - llama.cpp| over the first-step logits of all prompts: {overall:.6g}")


def _gguf_version():
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:
        return None


if __name__ == "__main__":
    main()
