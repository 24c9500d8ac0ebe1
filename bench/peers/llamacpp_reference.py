#!/usr/bin/env python3
"""Greedy reference continuations and logits from llama.cpp on the CPU, through llama-cpp-python.

For each of five prompts it records llama.cpp's prompt token ids (no BOS: the model's
add_bos_token is false), the 64 greedy continuation token ids, the top-2 logits at each of the
64 steps and the full logits vector at the first step. Generation does not stop at an end-of-turn
token: every prompt gets exactly 64 tokens, so a comparison is over the same 64 steps everywhere.

    python3 bench/peers/llamacpp_reference.py --model .models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out bench/reference/smollm2-q4_1

llama-cpp-python either comes from `pip install llama-cpp-python` (it builds llama.cpp), or from
its sdist's `llama_cpp/` directory on PYTHONPATH with LLAMA_CPP_LIB_PATH naming a directory that
holds a libllama.so built from the same sdist's vendor/llama.cpp. Format of the outputs:
bench/reference/smollm2-q4_1/README.md.
"""

import os
import sys

# bench/peers also holds scripts that may be named like standard modules: keep this directory off
# the import path, which Python puts first when it runs a script.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import argparse
import hashlib
import json
import re

import numpy as np
import llama_cpp

N_STEPS = 64

CHAT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# (name, kind, text). The chat prompt is the model's own chat template rendered for one user
# message with add_generation_prompt=True (the template inserts the default system message);
# the script checks that rendering against the template in the GGUF metadata.
PROMPTS = [
    (
        "chat",
        "chat",
        "<|im_start|>system\n" + CHAT_SYSTEM + "<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France, and what is it famous for?<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    (
        "story",
        "plain continuation",
        "Once upon a time, in a small village at the edge of a great forest, there lived",
    ),
    (
        "list",
        "list",
        "Here is a list of the eight planets of the solar system, in order from the Sun:\n1.",
    ),
    (
        "code",
        "code",
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    ),
    (
        "fact",
        "fact question",
        "Question: Who wrote the play Romeo and Juliet?\nAnswer:",
    ),
]


def dump_json(obj, path):
    """Indented JSON with arrays of numbers kept on one line."""
    text = json.dumps(obj, indent=1, ensure_ascii=False)
    text = re.sub(r"\[[-+0-9.e,\s]*\]", lambda m: re.sub(r"\s+", " ", m.group(0)).replace("[ ", "[").replace(" ]", "]"), text)
    with open(path, "w") as f:
        f.write(text + "\n")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_chat_template(llm, text):
    template = llm.metadata.get("tokenizer.chat_template")
    if template is None:
        return "no tokenizer.chat_template in the model"
    import jinja2  # a dependency of llama-cpp-python

    user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    rendered = jinja2.Environment().from_string(template).render(
        messages=[{"role": "user", "content": user}], add_generation_prompt=True
    )
    if rendered != text:
        sys.exit(f"chat prompt differs from the model's template rendering:\n{rendered!r}")
    return "matches tokenizer.chat_template (one user message, add_generation_prompt=True)"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=512,
        n_batch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_gpu_layers=0,
        logits_all=True,
        verbose=False,
    )
    n_vocab = llm.n_vocab()
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "true") == "true"
    if add_bos:
        sys.exit("this reference assumes add_bos_token = false")
    template_note = check_chat_template(llm, PROMPTS[0][2])

    os.makedirs(args.out, exist_ok=True)
    first_logits = np.zeros((len(PROMPTS), n_vocab), dtype=np.float32)
    records = []
    for p, (name, kind, text) in enumerate(PROMPTS):
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        generated, top2_ids, top2_logits = [], [], []
        for step in range(N_STEPS):
            logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            if step == 0:
                first_logits[p] = logits
            # Top two by value; among equal values the lower id first (np.argsort is stable).
            order = np.argsort(-logits, kind="stable")[:2]
            top2_ids.append([int(order[0]), int(order[1])])
            top2_logits.append([float(logits[order[0]]), float(logits[order[1]])])
            tok = int(order[0])
            generated.append(tok)
            if step + 1 < N_STEPS:
                llm.eval([tok])
        gen_text = llm.detokenize(generated, special=True).decode("utf-8", errors="replace")
        margins = [a - b for a, b in top2_logits]
        records.append(
            {
                "name": name,
                "kind": kind,
                "text": text,
                "prompt_ids": ids,
                "generated_ids": generated,
                "generated_text": gen_text,
                "top2_ids": top2_ids,
                "top2_logits": top2_logits,
                "min_top2_margin": min(margins),
                "min_top2_margin_step": int(np.argmin(margins)),
            }
        )
        print(f"[{name}] {len(ids)} prompt tokens -> {gen_text!r}", file=sys.stderr)

    first_logits.astype("<f4").tofile(os.path.join(args.out, "first_logits_llamacpp.f32"))
    meta = {
        "model": {
            "file": os.path.basename(args.model),
            "sha256": sha256_file(args.model),
            "size": os.path.getsize(args.model),
        },
        "peer": {
            "llama_cpp_python": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip(),
            "threads": args.threads,
            "n_ctx": 512,
            "n_batch": 512,
            "prompt_eval": "the whole prompt in one batch, then one token per decode call",
        },
        "chat_template_check": template_note,
        "n_vocab": n_vocab,
        "n_steps": N_STEPS,
        "first_logits_file": "first_logits_llamacpp.f32",
        "first_logits_layout": f"little-endian f32, row-major [{len(PROMPTS)}, {n_vocab}], rows in prompt order",
        "prompts": records,
    }
    dump_json(meta, os.path.join(args.out, "llamacpp.json"))


if __name__ == "__main__":
    main()
