"""Kiln's CPU forward against transformers' on tiny random models of each architecture Kiln
loads from Hugging Face folders (Llama, Qwen2 with q/k/v bias, Qwen3 with q/k norm and tied
embeddings). Weights are bf16 on disk; both sides compute in fp32 from the same bf16 values.

usage: hf_tiny_reference.py KILN_HF_LOGITS_BINARY WORKDIR
Prints one line per model: the largest |logit difference| relative to the largest |logit|, for the
prefill's last position and for 3 decode steps, and exits 1 if any exceeds 1e-3.
"""
import json, os, subprocess, sys
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
import transformers

binary, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
torch.manual_seed(0)

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. " * 20, "Kiln runs models."], trainer)

common = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, rope_theta=10000.0)
configs = {
    "llama": transformers.LlamaConfig(**common, tie_word_embeddings=False),
    "qwen2": transformers.Qwen2Config(**common, tie_word_embeddings=False),
    "qwen3": transformers.Qwen3Config(**common, head_dim=64, tie_word_embeddings=True),
}
ids = [5, 17, 42, 99, 3, 250, 7, 64, 11, 128]
prefix = 7
worst = 0.0
for name, config in configs.items():
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 and p.shape[0] in (64, 256) else 0.0)).to(torch.bfloat16).float())
    folder = os.path.join(work, name)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    model = model.float().eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].double()
    out = subprocess.run([binary, folder, str(prefix)] + [str(i) for i in ids], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"{name}: kiln failed: {out.stderr.strip()}")
        worst = float("inf")
        continue
    kiln = torch.tensor(json.loads(out.stdout)["logits"], dtype=torch.float64)
    rows = [ref[prefix - 1]] + [ref[i] for i in range(prefix, len(ids))]
    diffs = [float((k - r).abs().max() / r.abs().max()) for k, r in zip(kiln, rows)]
    worst = max(worst, max(diffs))
    print(f"{name}: transformers {transformers.__version__}; max |kiln - hf| / max |hf| per position: "
          + ", ".join(f"{d:.2e}" for d in diffs))
print(f"worst relative difference {worst:.2e} (limit 1e-3)")
sys.exit(0 if worst < 1e-3 else 1)
