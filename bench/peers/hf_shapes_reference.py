"""Kiln's GPU logits against transformers' on random-weight models in the exact shapes of real ones.

usage: hf_shapes_reference.py HF_LOGITS WORKDIR TOKENIZER_JSON SHAPE[=HF_FOLDER] ...

SHAPE is one of qwen3-8b, qwen3-0.6b (built here with transformers, random bf16 weights) or any name
whose HF_FOLDER is given (a folder of config.json + safetensors, e.g. `make_models.py`'s `hf/`, into
which TOKENIZER_JSON is copied). For each model, 40 token ids run through transformers on the GPU in
fp32 (the reference) and in bf16 (the yardstick of bf16 rounding), and through Kiln's GPU engine
(`HF_LOGITS --cuda FOLDER 32 IDS...`: a 32-token prefill, then 8 decode steps). Printed per model:
max |kiln - fp32| / max |fp32|, the same for transformers' bf16, and the top-1 agreement over the 9
positions. Exit status 1 when Kiln's difference exceeds 1.5x transformers' own bf16 difference (with
a floor of 1e-2) on any model.
"""
import json, os, shutil, subprocess, sys, time
import torch
import transformers

binary, work, tokenizer = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(work, exist_ok=True)
QWEN3 = {  # hidden, layers, heads, kv heads, head dim, ffn, vocab, tied
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936, False),
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936, True),
}
gen = torch.Generator().manual_seed(1)
ids = torch.randint(0, 49152, (40,), generator=gen).tolist()
prefix = 32
worst_ok = True
for arg in sys.argv[4:]:
    name, _, folder = arg.partition("=")
    made_here = not folder
    t0 = time.time()
    if made_here:
        H, L, NH, NKV, HD, FF, V, tied = QWEN3[name]
        config = transformers.Qwen3Config(hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                                          num_key_value_heads=NKV, head_dim=HD, intermediate_size=FF,
                                          vocab_size=V, tie_word_embeddings=tied, max_position_embeddings=40960,
                                          rope_theta=1000000.0, rms_norm_eps=1e-6, torch_dtype="bfloat16")
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.copy_(1 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0, 0.02)
        folder = os.path.join(work, name)
        model.save_pretrained(folder, safe_serialization=True)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16).cuda()
    shutil.copy(tokenizer, os.path.join(folder, "tokenizer.json"))
    model.eval()
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        bf16 = model(x).logits[0].double().cpu()
        model = model.float()
        ref = model(x).logits[0].double().cpu()
    del model
    torch.cuda.empty_cache()
    t1 = time.time()
    out = subprocess.run([binary, "--cuda", folder, str(prefix)] + [str(i) for i in ids], capture_output=True, text=True)
    t2 = time.time()
    if made_here:
        shutil.rmtree(folder, ignore_errors=True)
    if out.returncode != 0:
        print(f"{name}: kiln failed: {out.stderr.strip()[-2000:]}")
        worst_ok = False
        continue
    kiln = torch.tensor(json.loads(out.stdout)["logits"], dtype=torch.float64)
    rows = [prefix - 1] + list(range(prefix, len(ids)))
    r = ref[rows]
    b = bf16[rows]
    scale = r.abs().max(dim=1).values
    d_kiln = float(((kiln - r).abs().max(dim=1).values / scale).max())
    d_bf16 = float(((b - r).abs().max(dim=1).values / scale).max())
    top1 = int((kiln.argmax(dim=1) == r.argmax(dim=1)).sum())
    top1_bf16 = int((b.argmax(dim=1) == r.argmax(dim=1)).sum())
    limit = max(1.5 * d_bf16, 1e-2)
    ok = d_kiln <= limit
    worst_ok &= ok
    print(f"{name}: max|kiln - hf fp32|/max|hf| {d_kiln:.2e} | hf bf16 {d_bf16:.2e} | limit {limit:.2e} | "
          f"top-1 kiln {top1}/{len(rows)}, hf bf16 {top1_bf16}/{len(rows)} | {'ok' if ok else 'FAIL'} "
          f"(reference {t1 - t0:.0f} s, kiln {t2 - t1:.0f} s)", flush=True)
print(f"transformers {transformers.__version__}, torch {torch.__version__}")
sys.exit(0 if worst_ok else 1)
