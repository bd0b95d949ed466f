"""A CUDA workload that generates tokens step by step, for the real-GPU tests.

``--kind kv``: a toy decoder-only transformer that keeps its KV cache on the GPU.
``--kind rnn``: a toy recurrent model that keeps its hidden state on the GPU.
``--kind hold``: allocates ``--hold-gib`` of device memory filled with a pattern and checks it.
Greedy decoding with fixed seeds: an uninterrupted run and a checkpointed-and-restored run
must write the same tokens to ``--out``, one per line. Run as a script, never imported.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

VOCAB, DIM, HEADS, LAYERS = 512, 256, 4, 4


class KvDecoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(DIM, 3 * DIM) for _ in range(LAYERS))
        self.out = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def step(self, token: torch.Tensor, cache: list[list[torch.Tensor]]) -> torch.Tensor:
        x = self.emb(token)[None, :]  # (1, DIM)
        for i in range(LAYERS):
            q, k, v = self.qkv[i](x).chunk(3, dim=-1)
            cache[i][0] = torch.cat([cache[i][0], k], dim=0)
            cache[i][1] = torch.cat([cache[i][1], v], dim=0)
            qh = q.view(HEADS, 1, DIM // HEADS)
            kh = cache[i][0].view(-1, HEADS, DIM // HEADS).transpose(0, 1)
            vh = cache[i][1].view(-1, HEADS, DIM // HEADS).transpose(0, 1)
            att = torch.softmax(qh @ kh.transpose(1, 2) / (DIM // HEADS) ** 0.5, dim=-1)
            x = x + self.out[i]((att @ vh).transpose(0, 1).reshape(1, DIM))
        return self.head(x)[0]


class Recurrent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.cell = torch.nn.GRUCell(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def step(self, token: torch.Tensor, state: list[torch.Tensor]) -> torch.Tensor:
        state[0] = self.cell(self.emb(token)[None, :], state[0])
        return self.head(state[0])[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=["kv", "rnn", "hold"], required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hold-gib", type=float, default=4.0)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True
    dev = torch.device("cuda")
    with open(args.out, "a", buffering=1) as out, torch.no_grad():
        if args.kind == "hold":
            n = int(args.hold_gib * 2**30) // 4
            block = torch.arange(n, device=dev, dtype=torch.int32)
            expected = int(block.sum(dtype=torch.int64).item())
            out.write("ready\n")
            for _ in range(args.steps):
                time.sleep(args.delay)
            ok = int(block.sum(dtype=torch.int64).item()) == expected
            out.write("intact\n" if ok else "CORRUPT\n")
            return 0 if ok else 1
        model: KvDecoder | Recurrent = (
            (KvDecoder() if args.kind == "kv" else Recurrent()).to(dev).eval()
        )
        if args.kind == "kv":
            state: list[Any] = [[torch.empty(0, DIM, device=dev)] * 2 for _ in range(LAYERS)]
        else:
            state = [torch.zeros(1, DIM, device=dev)]
        token = torch.tensor(1, device=dev)
        for _ in range(args.steps):
            logits = model.step(token, state)
            token = torch.argmax(logits)
            out.write(f"{int(token.item())}\n")
            if args.delay:
                time.sleep(args.delay)
    return 0


if __name__ == "__main__":
    sys.exit(main())
