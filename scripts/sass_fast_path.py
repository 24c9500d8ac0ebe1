#!/usr/bin/env python3
"""The fast path of a kernel's SASS (`cuobjdump -sass` or `nvdisasm -c` output): the instructions a
thread issues on the path that loads and stores the most and avoids the slow branches.

The control-flow graph is split at branches; each basic block counts its instructions (BSSY,
BSYNC and BRA included: they issue too). The fast path is the path from the entry to the final
EXIT that first maximizes the global loads and stores it passes (so that no unit of the segment
is skipped) and then minimizes the instructions, without entering a block that calls a
subroutine (the slow paths of division and square root) or uses a double-precision or
division-check instruction (the reference's way for out-of-range blocks). Back edges are not
followed: the kernels counted here are fully unrolled on their fast path.

Usage: sass_fast_path.py FILE.sass [--list]   (prints the count and the mix of opcodes; `scripts/
sass-loops KERNEL ARCH ... --fast-path` compiles a define set and prints the same)
"""

import collections
import functools
import re
import sys

SLOW = ("CALL", "DADD", "DMUL", "DFMA", "DSETP", "FRND")


def load(path):
    instructions, labels, pending = [], {}, []
    for line in open(path).read().splitlines():
        m = re.match(r"^(\.L_x_\d+):", line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"^\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
        if m:
            address = int(m.group(1), 16)
            for p in pending:
                labels[p] = address
            pending = []
            instructions.append((address, m.group(2).strip()))
    # The entry function ends at its last unconditional EXIT; subroutines follow it. Branch
    # targets are labels (nvdisasm) or addresses (cuobjdump).
    end = max(i for i, (_, t) in enumerate(instructions) if t == "EXIT")
    instructions = instructions[: end + 1]
    index = {a: i for i, (a, _) in enumerate(instructions)}

    def target(text):
        m = re.search(r"BRA\s+(?:\S+,\s*)?(?:`\((\.L_x_\d+)\)|(0x[0-9a-f]+))", text)
        if not m:
            return None
        return index.get(labels.get(m.group(1)) if m.group(1) else int(m.group(2), 16))

    leaders = {0}
    for i, (_, text) in enumerate(instructions):
        if "BRA" in text or "EXIT" in text:
            if i + 1 < len(instructions):
                leaders.add(i + 1)
            t = target(text)
            if t is not None:
                leaders.add(t)
    leaders = sorted(leaders)
    blocks, successors = {}, {}
    for k, start in enumerate(leaders):
        stop = leaders[k + 1] if k + 1 < len(leaders) else len(instructions)
        blocks[start] = (start, stop)
        last = instructions[stop - 1][1]
        conditional = last.startswith("@") or re.search(r"BRA\s+!?U?P\w+,", last) is not None
        out = []
        if "BRA" in last:
            t = target(last)
            if t is not None:
                out.append(t)
            if conditional and stop < len(instructions):
                out.append(stop)
        elif "EXIT" in last and not last.startswith("@"):
            out = ["END"]
        elif stop < len(instructions):
            out.append(stop)
        successors[start] = out
    return instructions, blocks, successors


def opcode(text):
    word = text.split()[1] if text.startswith("@") else text.split()[0]
    return word.split(".")[0]


def fast_path(instructions, blocks, successors):
    sys.setrecursionlimit(100000)

    def slow(b):
        return any(any(s in instructions[i][1] for s in SLOW) for i in range(*blocks[b]))

    def memory(b):
        return sum(("LDG" in instructions[i][1]) or ("STG" in instructions[i][1]) for i in range(*blocks[b]))

    @functools.lru_cache(None)
    def best(b):
        if slow(b):
            return (-1e9, 0, None)
        choice = (-1e9, 0, None)
        for t in successors[b]:
            if t == "END":
                candidate = (0, 0, "END")
            elif t <= b:
                continue
            else:
                r = best(t)
                candidate = (r[0], r[1], t)
            if candidate[:2] > choice[:2]:
                choice = candidate
        return (choice[0] + memory(b), choice[1] - (blocks[b][1] - blocks[b][0]), choice[2])

    if best(0)[0] < 0:
        raise SystemExit("no path from the entry to EXIT avoids the slow blocks")
    path, b = [], 0
    while b not in ("END", None):
        path.extend(range(*blocks[b]))
        b = best(b)[2]
    return path


def report(path, listing=False):
    """The fast path's count and opcode mix (and with `listing` its instructions) as text."""
    instructions, blocks, successors = load(path)
    fast = fast_path(instructions, blocks, successors)
    mix = collections.Counter(opcode(instructions[i][1]) for i in fast)
    lines = [f"fast path: {len(fast)} instructions ({mix['LDG'] + mix['STG']} global loads and stores)",
             "  " + ", ".join(f"{op} {n}" for op, n in mix.most_common())]
    if listing:
        lines += ["%05x  %s" % instructions[i] for i in fast]
    return "\n".join(lines)


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print(report(sys.argv[1], "--list" in sys.argv))


if __name__ == "__main__":
    main()
