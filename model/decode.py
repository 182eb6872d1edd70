"""Incremental decoding over a ring of ``mem_len`` cached keys and values.

A token's keys and values are projected once, when it enters the memory, and kept
in a per-layer ring buffer (slot = position % mem_len); the position term reads a
per-layer table ``W_r R_d`` for distances 0..mem_len computed once at start-up.
Every query attends to itself and exactly the ``mem_len`` tokens before it (the
reference model's ``same_length`` window), so prefill chunk sizes, request
boundaries and batching never change a result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from model.errors import InvalidRequestError
from model.transformer_xl import MemTransformerLM


@dataclass
class DecodeState:
    """The hot form of a batch of sessions; rings are indexed by absolute position % mem_len."""

    hid: Tensor  # [n_layer, batch, mem_len, d_model]  layer inputs (the paper's mems)
    k: Tensor  # [n_layer, batch, n_head, mem_len, d_head]
    v: Tensor  # [n_layer, batch, n_head, mem_len, d_head]
    seen: Tensor  # [batch] int64: tokens seen
    last_logits: Tensor  # [batch, vocab]: the prediction after the last token seen

    @property
    def batch(self) -> int:
        return self.seen.numel()

    def rows(self, index: list[int] | Tensor) -> DecodeState:
        idx = torch.as_tensor(index, device=self.seen.device, dtype=torch.long)
        return DecodeState(self.hid[:, idx], self.k[:, idx], self.v[:, idx], self.seen[idx], self.last_logits[idx])

    @staticmethod
    def cat(states: list[DecodeState]) -> DecodeState:
        if len(states) == 1:
            return states[0]
        return DecodeState(torch.cat([s.hid for s in states], 1), torch.cat([s.k for s in states], 1),
                           torch.cat([s.v for s in states], 1), torch.cat([s.seen for s in states]),
                           torch.cat([s.last_logits for s in states]))


class Decoder:
    """The model's weights arranged for incremental decoding at a given ``mem_len``/``clamp_len``."""

    def __init__(self, model: MemTransformerLM, *, mem_len: int, clamp_len: int = 0) -> None:
        if mem_len < 1:
            raise InvalidRequestError("mem_len must be at least 1 for decoding", param="mem_len")
        self.model, self.cfg = model.eval(), model.cfg
        self.mem_len, self.clamp_len = mem_len, clamp_len
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        dist = torch.arange(mem_len + 1, device=self.device)  # [mem_len+1]
        if clamp_len > 0:
            dist = dist.clamp(max=clamp_len)
        with torch.no_grad():
            pos_emb = model.pos_emb(dist).to(self.dtype)  # [mem_len+1, d_model]
            self.r_head_k = torch.stack([  # [n_layer, n_head, mem_len+1, d_head]
                layer.dec_attn.r_net(pos_emb).view(mem_len + 1, self.cfg.n_head, self.cfg.d_head).transpose(0, 1)
                for layer in model.layers])
            biases = [model.biases(i) for i in range(self.cfg.n_layer)]
            self.r_w_bias = torch.stack([u for u, _ in biases])[:, :, None]  # [n_layer, n_head, 1, d_head]
            self.r_r_bias = torch.stack([v for _, v in biases])[:, :, None]  # [n_layer, n_head, 1, d_head]

    def empty(self, batch: int = 1) -> DecodeState:
        c, m, kw = self.cfg, self.mem_len, dict(device=self.device, dtype=self.dtype)
        return DecodeState(
            hid=torch.zeros(c.n_layer, batch, m, c.d_model, **kw),
            k=torch.zeros(c.n_layer, batch, c.n_head, m, c.d_head, **kw),
            v=torch.zeros(c.n_layer, batch, c.n_head, m, c.d_head, **kw),
            seen=torch.zeros(batch, dtype=torch.long, device=self.device),
            last_logits=torch.zeros(batch, c.vocab_size, device=self.device, dtype=torch.float32),
        )

    def _masks(self, seen: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
        """Distance index [batch, 1, chunk, mem_len+chunk] into the position table, and the key mask."""
        m = self.mem_len
        pos = seen[:, None] + torch.arange(chunk, device=seen.device)  # [batch, chunk]
        last = seen[:, None] - 1  # [batch, 1]
        p_ring = last - (last - torch.arange(m, device=seen.device)).remainder(m)  # [batch, mem_len] slot positions
        d_ring = pos[:, :, None] - p_ring[:, None, :]  # [batch, chunk, mem_len]
        d_self = (torch.arange(chunk, device=seen.device)[:, None] - torch.arange(chunk, device=seen.device))
        d_self = d_self.expand(seen.numel(), chunk, chunk)  # [batch, chunk, chunk]
        dist = torch.cat([d_ring, d_self], dim=-1)  # [batch, chunk, mem_len+chunk]
        blocked = (dist < 0) | (dist > m)
        blocked[:, :, :m] |= (p_ring < 0)[:, None, :]  # empty slots
        return dist.clamp(0, m)[:, None], blocked[:, None]

    @torch.no_grad()
    def step(self, state: DecodeState, tokens: Tensor) -> Tensor:
        """Feed ``tokens [batch, chunk]`` to every session of ``state`` (in place); logits [batch, chunk, vocab]."""
        model, cfg, m = self.model, self.cfg, self.mem_len
        bsz, chunk = tokens.shape
        dist, blocked = self._masks(state.seen, chunk)  # [batch, 1, chunk, mem_len+chunk]
        keep = min(chunk, m)  # only the last mem_len tokens of a chunk enter the ring
        rows = torch.arange(bsz, device=tokens.device)[:, None]  # [batch, 1]
        slots = (state.seen[:, None] + torch.arange(chunk - keep, chunk, device=tokens.device)).remainder(m)
        h = model.word_emb(tokens) * model.emb_scale  # [batch, chunk, d_model]
        for i, layer in enumerate(model.layers):
            attn, k_l, v_l = layer.dec_attn, state.k[i], state.v[i]  # k_l [batch, H, mem_len, Dh]
            x = attn.layer_norm(h) if cfg.pre_lnorm else h
            q, k, v = attn.qkv_net(x).view(bsz, chunk, 3, cfg.n_head, cfg.d_head).permute(2, 0, 3, 1, 4)
            q_u, q_v = q + self.r_w_bias[i], q + self.r_r_bias[i]  # [batch, H, chunk, Dh]
            ac = torch.cat([q_u @ k_l.transpose(-1, -2), q_u @ k.transpose(-1, -2)], -1)  # [batch, H, chunk, m+chunk]
            bd = (q_v @ self.r_head_k[i].transpose(-1, -2)).gather(-1, dist.expand(-1, cfg.n_head, -1, -1))
            score = ((ac + bd) * attn.scale).masked_fill(blocked, float("-inf"))  # [batch, H, chunk, m+chunk]
            prob = F.softmax(score.float(), dim=-1).to(q.dtype)
            vec = prob[..., :m] @ v_l + prob[..., m:] @ v  # [batch, H, chunk, Dh]
            out = attn.o_net(vec.transpose(1, 2).reshape(bsz, chunk, -1))  # [batch, chunk, d_model]
            h_next = layer.pos_ff(h + out if cfg.pre_lnorm else attn.layer_norm(h + out))
            state.hid[i][rows, slots] = h[:, chunk - keep:]  # [batch, keep, d_model]
            k_l[rows, :, slots] = k[:, :, chunk - keep:].transpose(1, 2)  # [batch, keep, H, Dh]
            v_l[rows, :, slots] = v[:, :, chunk - keep:].transpose(1, 2)
            h = h_next
        logits = model.out_layer(h).float()  # [batch, chunk, vocab]
        state.seen += chunk
        state.last_logits = logits[:, -1]
        return logits

    def prefill(self, state: DecodeState, tokens: Tensor, *, chunk_size: int = 512) -> Tensor:
        """Feed a long ``tokens [batch, n]`` in chunks (a banded mask per chunk); logits [batch, n, vocab]."""
        if tokens.size(1) == 0:
            return torch.zeros(state.batch, 0, self.cfg.vocab_size, device=self.device)
        return torch.cat([self.step(state, tokens[:, s:s + chunk_size])
                          for s in range(0, tokens.size(1), chunk_size)], dim=1)
