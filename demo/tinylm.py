"""tinylm: a small language model in numpy that generates tokens step by step.

The demo workload for gpusnap. Its weights are random but deterministic (from ``--seed``); it
holds what a serving process holds between steps — a KV cache that grows with every token in
two attention layers, and the recurrent state of a gated (GRU-like) state-space layer — and it
appends one line per generated token to ``--out``: the step, the token and a digest of the
hidden state, so any difference in restored state shows up in the file.

The output file is written with O_APPEND after truncating it to the length this process has
written: a process restored from an older checkpoint rewrites the lines written after it.

    python demo/tinylm.py --out tokens.txt --steps 200 --seed 7 --interval 0.05
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import numpy as np
import numpy.typing as npt

VOCAB = 256
DIM = 96
HEADS = 4
LAYERS = 2
PROMPT = b"gpusnap keeps long-context sessions alive: "

F32 = npt.NDArray[np.float32]


class TinyLM:
    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)

        def w(*shape: int) -> F32:
            weights: F32 = (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
            return weights

        self.embed = w(VOCAB, DIM)
        self.layers = [
            {
                "q": w(DIM, DIM),
                "k": w(DIM, DIM),
                "v": w(DIM, DIM),
                "o": w(DIM, DIM),
                "up": w(DIM, 2 * DIM),
                "down": w(2 * DIM, DIM),
            }
            for _ in range(LAYERS)
        ]
        # The recurrent (state-space-like) layer: a gated update of a fixed-size state.
        self.gz, self.gr, self.gh = w(2 * DIM, DIM), w(2 * DIM, DIM), w(2 * DIM, DIM)
        self.unembed = w(DIM, VOCAB)
        self.kv: list[tuple[list[F32], list[F32]]] = [([], []) for _ in range(LAYERS)]
        self.state = np.zeros(DIM, dtype=np.float32)
        self.rng = np.random.default_rng(seed + 1)  # sampling; its state is part of the process

    def step(self, token: int) -> F32:
        x = self.embed[token].copy()
        for layer, (keys, values) in zip(self.layers, self.kv, strict=True):
            h = _norm(x)
            keys.append(h @ layer["k"])
            values.append(h @ layer["v"])
            q = (h @ layer["q"]).reshape(HEADS, -1)
            k = np.stack(keys).reshape(len(keys), HEADS, -1)
            v = np.stack(values).reshape(len(values), HEADS, -1)
            scores = np.einsum("hd,thd->ht", q, k) / np.sqrt(q.shape[1])
            att = np.exp(scores - scores.max(axis=1, keepdims=True))
            att /= att.sum(axis=1, keepdims=True)
            x = x + np.einsum("ht,thd->hd", att, v).reshape(-1) @ layer["o"]
            x = x + np.maximum(_norm(x) @ layer["up"], 0.0) @ layer["down"]
        xs = np.concatenate([_norm(x), self.state])
        z = _sigmoid(xs @ self.gz)
        r = _sigmoid(xs @ self.gr)
        cand = np.tanh(np.concatenate([_norm(x), r * self.state]) @ self.gh)
        self.state = ((1 - z) * self.state + z * cand).astype(np.float32)
        logits: F32 = (_norm(x + self.state) @ self.unembed).astype(np.float32)
        return logits

    def sample(self, logits: F32, temperature: float = 0.8) -> int:
        p = np.exp((logits - logits.max()) / temperature)
        p /= p.sum()
        return int(self.rng.choice(VOCAB, p=p))


def _norm(x: F32) -> F32:
    out: F32 = (x / np.sqrt(np.mean(x * x) + 1e-5)).astype(np.float32)
    return out


def _sigmoid(x: F32) -> F32:
    out: F32 = (1.0 / (1.0 + np.exp(-x))).astype(np.float32)
    return out


class Out:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.length = 0
        os.ftruncate(self.fd, 0)

    def write(self, data: bytes) -> None:
        os.ftruncate(self.fd, self.length)
        os.write(self.fd, data)
        self.length += len(data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--interval", type=float, default=0.05, help="seconds between tokens")
    p.add_argument("--pid-file")
    args = p.parse_args()
    if args.pid_file:
        with open(args.pid_file, "w") as f:
            f.write(f"{os.getpid()}\n")
    model = TinyLM(args.seed)
    out = Out(args.out)
    logits = np.zeros(VOCAB, dtype=np.float32)
    for t in PROMPT:  # prefill: fills the KV cache and the recurrent state
        logits = model.step(t)
    for step in range(1, args.steps + 1):
        token = model.sample(logits)
        logits = model.step(token)
        digest = hashlib.sha256(model.state.tobytes() + logits.tobytes()).hexdigest()[:16]
        out.write(b"%05d %3d %s\n" % (step, token, digest.encode()))
        if args.interval:
            time.sleep(args.interval)
    out.write(b"done\n")


if __name__ == "__main__":
    main()
