"""A lean forward pass for Llama-family models over a slot-based KV cache.

Hugging Face's module forward spends most of a small-batch decode step on per-call overhead
(cache objects, mask building, per-projection matmuls). Here the weights of a loaded HF model are
fused (one QKV matmul, one gate/up matmul) and run against a preallocated cache where sequence i
of the running batch lives in slot i, so a decode step is ~20 tensor ops per layer and no copies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.graphs import DecodeGraphs
from engine.item_attention import ItemAttention

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class Linear:
    """y = x @ W.T + b. On CPU the weight is prepacked for oneDNN: on the machines we measured this
    was 1.5-3x faster than MKL for decode-sized inputs and, unlike MKL (whose 1-row path differs from
    its many-row path), gives every row the same bits whatever the batch size, which keeps greedy
    answers independent of their batch mates."""

    PACK_HINT = 16  # batch size oneDNN tunes the packed layout for; any batch size still works

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.bias = bias
        self.weight, self.packed = weight, False
        if weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
            try:
                self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, self.PACK_HINT)
                self.packed = True
            except RuntimeError:  # e.g. bfloat16 on a CPU without bf16 instructions
                pass

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x), fused into the matmul where possible."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
        return residual + F.linear(x, self.weight, self.bias)


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear


EAGER_LOGIT_ROWS = 256  # an item asking for more rows (a prompt scored whole) gets them as they are read


class LogitRows:
    """Logits of a pass's rows, computed as they are read. A pass returns these instead of a tensor
    when an item asks for more than EAGER_LOGIT_ROWS rows (a prompt scored whole, for `echo` with
    `logprobs`): all at once, its float32 logits would take rows x vocab x 4 bytes (0.4 GB for 2,000
    tokens of a 49k vocabulary, 2 GB for 4,000 of a 128k one). Indexed as that tensor would be: a
    row or a list of rows gives logits, a slice gives LogitRows."""

    def __init__(self, hidden: torch.Tensor, head):
        self.hidden, self.head = hidden, head

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def __getitem__(self, index):
        if isinstance(index, slice):
            return LogitRows(self.hidden[index], self.head)
        if isinstance(index, int):
            return self.head(self.hidden[index].unsqueeze(0))[0]
        return self.head(self.hidden[index])


@dataclass
class PrefillItem:
    """One sequence to prefill: `token_ids` go into `slot` starting at cache position `start`.
    `prefix_end`: also give the logits after cache position `prefix_end - 1` (the end of a shared
    prefix that is cached as it is prefilled), when it falls inside this item and before its end.
    `logit_rows`: how many of the item's last tokens to give logits for."""

    slot: int
    token_ids: list[int]
    start: int
    prefix_end: int = 0
    logit_rows: int = 1

    def prefix_row(self) -> int | None:
        """Offset in `token_ids` of the token whose logits `prefix_end` asks for, or None."""
        end = self.start + len(self.token_ids)
        return self.prefix_end - 1 - self.start if self.start < self.prefix_end < end else None


def row_ranges(items, offset: int = 0) -> list[tuple[int, int]]:
    """Row ranges of the items' tokens packed one after another, starting at row `offset`."""
    bounds = []
    for it in items:
        bounds.append((offset, offset + len(it.token_ids)))
        offset += len(it.token_ids)
    return bounds


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: x*cos + rotate_half(x)*sin, with rotate_half's sign folded into the sine
    table so the rotation is a single roll."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class LlamaRunner:
    """Holds fused weights and the KV cache; runs prefill and decode. No scheduling here."""

    def __init__(self, hf_model, max_slots: int, max_len: int, cuda_graphs: bool = False):
        cfg = hf_model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type '{cfg.model_type}' is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        inner = hf_model.model
        self.device = hf_model.device
        self.dtype = next(hf_model.parameters()).dtype
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.eps = cfg.rms_norm_eps
        self.max_len = max_len
        self.max_slots = max_slots
        self.fused_decode_attention = self.device.type != "cpu"
        self.batched_item_attention = self.device.type != "cpu"  # see engine.item_attention
        self.layers = [self._fuse(layer) for layer in inner.layers]
        self.embed = inner.embed_tokens.weight.detach()
        self.final_norm = inner.norm.weight.detach()
        self.lm_head = Linear(hf_model.lm_head.weight.detach())
        with torch.no_grad():
            positions = torch.arange(max_len, device=self.device)[None]
            probe = torch.zeros(1, device=self.device, dtype=torch.float32)
            cos, sin = inner.rotary_emb(probe, positions)
        half = self.head_dim // 2
        self.cos = cos[0].to(self.dtype)
        self.sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1).to(self.dtype)
        # One extra slot is scratch space for building prefix caches.
        shape = (len(self.layers), max_slots + 1, self.num_kv_heads, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # set here, or by a test that runs the padded pass eagerly on the CPU
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(self.plain_decode, max_slots, max_len, self.device, capture=True)

    @property
    def scratch_slot(self) -> int:
        return self.max_slots

    @staticmethod
    def _fuse(layer, deltas: dict[str, torch.Tensor] | None = None) -> _Layer:
        """The HF decoder layer's weights fused; `deltas` (projection name, e.g. "q_proj", to a tensor
        shaped like its weight) are added first: a LoRA adapter merged into a copy of the layer."""
        attn, mlp = layer.self_attn, layer.mlp
        deltas = deltas or {}

        def weight(name: str, module) -> torch.Tensor:
            base = module.weight.detach()
            return base + deltas[name].to(base.dtype) if name in deltas else base

        projections = (("q_proj", attn.q_proj), ("k_proj", attn.k_proj), ("v_proj", attn.v_proj))
        bias = None
        if attn.q_proj.bias is not None:
            bias = torch.cat([p.bias.detach() for _, p in projections])
        return _Layer(
            attn_norm=layer.input_layernorm.weight.detach(),
            qkv=Linear(torch.cat([weight(n, p) for n, p in projections]), bias),
            q_norm=attn.q_norm.weight.detach() if hasattr(attn, "q_norm") else None,
            k_norm=attn.k_norm.weight.detach() if hasattr(attn, "k_norm") else None,
            o=Linear(weight("o_proj", attn.o_proj)),
            mlp_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=Linear(torch.cat([weight("gate_proj", mlp.gate_proj), weight("up_proj", mlp.up_proj)])),
            down=Linear(weight("down_proj", mlp.down_proj)),
        )

    def fused_layer(self, index: int, hf_layer, deltas: dict[str, torch.Tensor]) -> _Layer:
        """Layer `index` as this runner holds it, or, with `deltas`, a fused copy of `hf_layer`
        (the same layer of the loaded model) with them added, for `run_layers`."""
        return self._fuse(hf_layer, deltas) if deltas else self.layers[index]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _rope(self, positions: torch.Tensor):
        return self.cos[positions][:, None], self.sin[positions][:, None]

    def _qkv(self, layer: _Layer, x: torch.Tensor, rope):
        """Project tokens [T, hidden] to rotated q [T, H, D] and k, v [T, Hkv, D]."""
        qkv = layer.qkv(self._norm(x, layer.attn_norm))
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = qkv.view(-1, h + 2 * hk, d)
        if layer.q_norm is not None:
            q, k, v = qkv.split((h, hk, hk), dim=1)
            qk = torch.cat((self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)), dim=1)
        else:
            qk, v = qkv[:, : h + hk], qkv[:, h + hk :]
        q, k = _rotate(qk, *rope).split((h, hk), dim=1)  # one rotation for queries and keys
        return q, k, v

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up(self._norm(x, layer.mlp_norm)).chunk(2, dim=-1)
        return layer.down.add_to(x, F.silu(gate) * up)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.final_hidden(x)).float()

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, extend: list[PrefillItem] = ()) -> torch.Tensor:
        """One token for each of the sequences in slots 0..B-1; returns float32 logits [B, vocab].
        `extend`: more tokens for some of those sequences, right after their decode token, run in
        the same pass (a constraint's forced tokens, drafted tokens to verify), or for sequences in
        other slots (B and up) that do not decode (prompts being prefilled); the logits of each
        item's last `logit_rows` tokens follow the B rows, item after item, then those after each
        `prefix_end` that falls inside its item, as `prefill` gives them.
        The matmuls compute every row on its own, so the decode rows get the same bits either way.
        A plain pass (no `extend`) replays a CUDA graph where the runner has them (engine.graphs)."""
        if self.graphs is not None and not extend:
            return self.graphs.decode(tokens, positions)
        return self._decode(tokens, positions, extend)

    def plain_decode(self, tokens: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
        """The plain pass with attention over a fixed `span` of cache positions: no host sync and
        no shape that depends on the values, as a CUDA graph needs."""
        return self._decode(tokens, positions, (), span)

    @torch.inference_mode()
    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor, extend: list[PrefillItem] = (),
                span: int | None = None) -> torch.Tensor:
        batch = tokens.shape[0]
        slots = torch.arange(batch, device=self.device)
        if span is None:
            span = int(positions.max()) + 1
        hidden = (torch.arange(span, device=self.device)[None] > positions[:, None])[:, None, None]
        if extend:
            tokens = torch.cat([tokens, torch.tensor([t for it in extend for t in it.token_ids], device=self.device)])
            positions = torch.cat([positions, *(torch.arange(it.start, it.start + len(it.token_ids), device=self.device)
                                                for it in extend)])
        bounds = row_ranges(extend, batch)
        plan = ItemAttention(extend, bounds, self.device) if extend and self.batched_item_attention else None
        rope = self._rope(positions)
        group = self.num_heads // self.num_kv_heads
        x = F.embedding(tokens, self.embed)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, rope)
            self.k_cache[i, slots, :, positions[:batch]] = k[:batch]
            self.v_cache[i, slots, :, positions[:batch]] = v[:batch]
            if plan is not None:
                plan.write_kv(self.k_cache, self.v_cache, i, k, v)
            else:
                for it, (lo, hi) in zip(extend, bounds):
                    self.k_cache[i, it.slot, :, it.start : it.start + hi - lo] = k[lo:hi].transpose(0, 1)
                    self.v_cache[i, it.slot, :, it.start : it.start + hi - lo] = v[lo:hi].transpose(0, 1)
            keys, values = self.k_cache[i, :batch, :, :span], self.v_cache[i, :batch, :, :span]
            if self.fused_decode_attention:
                attn = F.scaled_dot_product_attention(q[:batch, :, None], keys, values, attn_mask=~hidden,
                                                      enable_gqa=True)
            else:  # one query per sequence: on CPU plain batched matmuls beat SDPA's kernel here
                qd = q[:batch].view(batch, self.num_kv_heads, group, self.head_dim)
                scores = (qd @ keys.transpose(-1, -2) * self.head_dim**-0.5).masked_fill_(hidden, float("-inf"))
                attn = scores.softmax(dim=-1) @ values
            attn = attn.reshape(batch, -1)
            if plan is not None:
                more = plan.attend(q, self.k_cache, self.v_cache, i)
                attn = torch.cat([attn, more.reshape(more.shape[0], -1)])
            elif extend:
                more = [self._prefill_attention(q[lo:hi], i, it.slot, it.start, it.start + hi - lo)
                        for it, (lo, hi) in zip(extend, bounds)]
                attn = torch.cat([attn, *(m.reshape(m.shape[0], -1) for m in more)])
            x = layer.o.add_to(x, attn)
            x = self._mlp(layer, x)
        if extend:
            rows = list(range(batch)) + [r for it, (_, hi) in zip(extend, bounds) for r in range(hi - it.logit_rows, hi)]
            rows += [lo + it.prefix_row() for it, (lo, _) in zip(extend, bounds) if it.prefix_row() is not None]
            x = x[torch.tensor(rows, device=self.device)]
        return self._logit_rows(x, extend)

    @torch.inference_mode()
    def prefill(self, items: list[PrefillItem]) -> torch.Tensor:
        """Run the new tokens of several sequences packed together; returns logits of each item's last
        `logit_rows` tokens, item after item, then those of each item's `prefix_end` (in item order,
        for the items that ask)."""
        x, bounds = self.run_layers(items, self.layers)
        rows = [r for it, (_, hi) in zip(items, bounds) for r in range(hi - it.logit_rows, hi)]
        rows += [lo + it.prefix_row() for it, (lo, _) in zip(items, bounds) if it.prefix_row() is not None]
        return self._logit_rows(x[torch.tensor(rows, device=self.device)], items)

    def _logit_rows(self, x: torch.Tensor, items) -> torch.Tensor | LogitRows:
        """The rows' logits: a tensor, or LogitRows when an item asks for many rows."""
        if any(item.logit_rows > EAGER_LOGIT_ROWS for item in items):
            return LogitRows(x, self.logits)
        return self.logits(x)

    @torch.inference_mode()
    def run_layers(self, items: list[PrefillItem], layers: list[_Layer], x: torch.Tensor | None = None,
                   first: int = 0) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The packed items' tokens through `layers`, which stand for the model's layers first,
        first+1, ... (the model's own, or copies from `fused_layer`), from `x` [tokens, hidden] entering
        layer `first` (default: the tokens' embeddings); each layer's KV of the tokens goes into their
        slots. Returns the hidden states out of the last of them, and each item's row range. `prefill`
        is this over all the model's layers; a caller can run layers in parts, with other weights for
        some tokens (see predictor.predict.LeanPromptPass)."""
        tokens = torch.tensor([t for it in items for t in it.token_ids], device=self.device)
        positions = torch.cat([torch.arange(it.start, it.start + len(it.token_ids)) for it in items])
        positions = positions.to(self.device)
        bounds = row_ranges(items)
        plan = ItemAttention(items, bounds, self.device) if self.batched_item_attention else None
        rope = self._rope(positions)
        if x is None:
            x = F.embedding(tokens, self.embed)
        for i, layer in enumerate(layers, start=first):
            q, k, v = self._qkv(layer, x, rope)
            if plan is not None:
                plan.write_kv(self.k_cache, self.v_cache, i, k, v)
                out = plan.attend(q, self.k_cache, self.v_cache, i)
            else:
                out = torch.empty_like(q)
                for it, (lo, hi) in zip(items, bounds):
                    end = it.start + (hi - lo)
                    self.k_cache[i, it.slot, :, it.start:end] = k[lo:hi].transpose(0, 1)
                    self.v_cache[i, it.slot, :, it.start:end] = v[lo:hi].transpose(0, 1)
                    out[lo:hi] = self._prefill_attention(q[lo:hi], i, it.slot, it.start, end)
            x = layer.o.add_to(x, out.reshape(len(tokens), -1))
            x = self._mlp(layer, x)
        return x, bounds

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states out of the last layer after the final norm: what the LM head (or another head) reads."""
        return self._norm(x, self.final_norm)

    def _prefill_attention(self, q: torch.Tensor, layer: int, slot: int, start: int, end: int):
        keys = self.k_cache[layer, slot, :, :end][None]
        values = self.v_cache[layer, slot, :, :end][None]
        q = q.transpose(0, 1)[None]
        if start == 0:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
        else:  # queries sit at positions start..end-1 and see everything up to themselves
            rows = torch.arange(start, end, device=self.device)[:, None]
            mask = torch.arange(end, device=self.device)[None] <= rows
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached tokens of slot `src` into slot `dst`."""
        self.k_cache[:, dst, :, :length] = self.k_cache[:, src, :, :length]
        self.v_cache[:, dst, :, :length] = self.v_cache[:, src, :, :length]

    def read_slot(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.k_cache[:, slot, :, :length].clone(), self.v_cache[:, slot, :, :length].clone())

    def write_slot(self, slot: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        length = kv[0].shape[2]
        self.k_cache[:, slot, :, :length] = kv[0]
        self.v_cache[:, slot, :, :length] = kv[1]
