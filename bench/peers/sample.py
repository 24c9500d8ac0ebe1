"""PyTorch peer of `kiln bench sample`: sampling from fp32 logits (vocabulary 151936) for batch 1
and 64 the way PyTorch programs do it (Hugging Face's warpers): penalties by gather/scatter,
temperature, top-k by torch.topk, top-p by a sort and a cumulative sum, min-p by a comparison with
the largest probability, then torch.multinomial; greedy by argmax. The same modes as Kiln's table,
timed the same way (CUDA events around batches of launches, the median; logits rotated).

    python bench/peers/sample.py --out sample_torch.json
    kiln bench sample --peer sample_torch.json

Prints a table and writes {mode: {"BATCH": microseconds}}.
"""

import argparse
import json

import torch

MODES = {
    "greedy": dict(greedy=True),
    "temperature": dict(temperature=0.8),
    "top_k": dict(temperature=0.8, top_k=50),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "top_k_top_p": dict(temperature=0.8, top_k=50, top_p=0.9),
    "min_p": dict(temperature=0.8, min_p=0.05),
    "top_k_min_p": dict(temperature=0.8, top_k=50, min_p=0.05),
    "top_k_penalties": dict(temperature=0.8, top_k=50, top_p=0.9, repetition=1.1, frequency=0.2, presence=0.1),
    "penalties": dict(temperature=0.8, repetition=1.1, frequency=0.2, presence=0.1),
}


def sample(logits, history, greedy=False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition=1.0,
           frequency=0.0, presence=0.0):
    if repetition != 1.0 or frequency != 0.0 or presence != 0.0:
        logits = logits.clone()
        score = torch.gather(logits, 1, history)
        score = torch.where(score < 0, score * repetition, score / repetition)
        logits.scatter_(1, history, score)
        counts = torch.zeros_like(logits).scatter_add_(1, history, torch.ones_like(history, dtype=logits.dtype))
        logits = logits - counts * frequency - (counts > 0).to(logits.dtype) * presence
    if greedy:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_index = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False
        logits = logits.masked_fill(remove.scatter(1, sorted_index, remove), float("-inf"))
    probs = logits.softmax(-1)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    return torch.multinomial(probs, 1)


def timed(fn, batches, launches):
    for i in range(max(3, launches)):
        fn(i)
    times = []
    k = 0
    for _ in range(batches):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(launches):
            fn(k)
            k += 1
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / launches)
    times.sort()
    return times[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="sample_torch.json")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--launches", type=int, default=20)
    args = parser.parse_args()
    dev = torch.device("cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(dev)}")
    print(f"{'mode':<14} {'batch':>6} {'time_us':>10}")
    results = {}
    for batch in [1, 64]:
        sets = [(torch.rand(batch, args.vocab, device=dev) * 24 - 12) for _ in range(4)]
        history = (torch.arange(256, device=dev)[None, :] * 131 + torch.arange(batch, device=dev)[:, None] * 977) % args.vocab
        for mode, kwargs in MODES.items():
            us = timed(lambda i: sample(sets[i % len(sets)], history, **kwargs), args.batches, args.launches)
            results.setdefault(mode, {})[str(batch)] = us
            print(f"{mode:<14} {batch:>6} {us:>10.1f}")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
