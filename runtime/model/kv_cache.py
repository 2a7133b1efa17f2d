"""The per-layer KV cache, one row per running sequence, and causal GQA attention over it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .batch import SeqSpan


class KVCache(nn.Module):
    """Keys and values of ``max_batch`` sequences of up to ``max_seq_len`` positions, for one layer.

    Rows are assigned by the engine (a row per running sequence); a position is written once, when its token is
    forwarded, and read by every later token of the same row.
    """

    def __init__(
        self, max_batch: int, max_seq_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device
    ) -> None:
        super().__init__()
        if max_batch <= 0 or max_seq_len <= 0:
            raise ValueError(f"max_batch ({max_batch}) and max_seq_len ({max_seq_len}) must be positive")
        shape = (max_batch, max_seq_len, num_kv_heads, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)  # [B, P, KV, D]
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)  # [B, P, KV, D]

    @property
    def max_batch(self) -> int:
        return self.k.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[1]

    def update(self, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's keys and values in place.

        Semantics::

            K[rows[t], positions[t]] = k[t];  V[rows[t], positions[t]] = v[t]   for every token t

        Shape: rows [T], positions [T] int64; k, v [T, KV, D].
        """
        self.k.index_put_((rows, positions), k)
        self.v.index_put_((rows, positions), v)

    def attend_spans(self, q: torch.Tensor, spans: tuple[SeqSpan, ...]) -> torch.Tensor:
        """Eager causal attention, one SDPA call per sequence of the step over its cached prefix.

        Semantics::

            for (row, offset, n, end) in spans:            # the step's tokens of that row are positions end-n .. end-1
                out[offset + i] = softmax(q[offset + i] · K[row, :end].T / √D, keys j ≤ end - n + i) · V[row, :end]

        Shape: q [T, H, D]; returns [T, H, D]. Query head h reads KV head h // (H / KV) (GQA).
        """
        outputs = []
        for row, offset, count, end in spans:
            qs = q[offset : offset + count].transpose(0, 1)  # [H, n, D]
            ks = self.k[row, :end].transpose(0, 1)  # [KV, end, D]
            vs = self.v[row, :end].transpose(0, 1)
            mask = None
            if count > 1:
                query_pos = torch.arange(end - count, end, device=q.device)  # [n]
                mask = torch.arange(end, device=q.device)[None, :] <= query_pos[:, None]  # [n, end]
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)  # [H, n, D]
            outputs.append(out.transpose(0, 1))
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def attend_static(self, q: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Static-shape causal attention: every token reads its whole cache row, masked to positions ≤ its own.

        Semantics::

            out[t] = softmax(q[t] · K[rows[t]].T / √D, keys j ≤ positions[t]) · V[rows[t]]

        Shape: q [T, H, D]; rows, positions [T]; returns [T, H, D]. No host sync and no data-dependent shape: the
        form a traced (XLA) step uses, with padding tokens pointed at a spare row.
        """
        ks = self.k[rows].transpose(1, 2)  # [T, KV, P, D]
        vs = self.v[rows].transpose(1, 2)
        key_pos = torch.arange(self.max_seq_len, device=q.device)  # [P]
        mask = (key_pos[None, :] <= positions[:, None])[:, None, None, :]  # [T, 1, 1, P]
        out = F.scaled_dot_product_attention(q[:, :, None, :], ks, vs, attn_mask=mask, enable_gqa=True)  # [T, H, 1, D]
        return out[:, :, 0, :]
