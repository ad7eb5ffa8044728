"""DeepSeek-V4 compressed sparse attention (CSA): one layer's indexer step, in decode and in a prefill chunk.

A CSA layer of DeepSeek-V4 compresses every 4 tokens of a sequence into one entry, and each query token
attends to a few hundred of those entries, chosen by the lightning indexer. Per layer and step:

  (4) the indexer scores every compressed entry the token can see and keeps the top k
      (k = 512 for V4-Flash, 1024 for V4-Pro);
  (5) sparse attention of the query heads over the compressed KV of the selected entries, with an
      attention sink per head (a logit that joins the softmax but adds no value);
  (6) sliding-window attention over the last 128 tokens, and (7) the merge of both.

This example runs (4) with deep_indexer as an inference engine would: the FP4 indexer cache in pages of
64 compressed entries (256 tokens), written step by step; the compressed-entry counts of every query
token; the top-k selection in the index formats the sparse attention kernels take. With --check it
recomputes (4) and (5) in plain PyTorch and compares. (6) and (7) are not covered.

Simplifications: the compressor's outputs (the indexer keys and the attention's compressed KV of each new
entry) and the queries are random; the attention's compressed KV is kept in float32 (a real engine
stores it in its own, smaller format, with RoPE on part of it), and has 16 query heads here.

    python examples/v4_csa_indexer.py [--pro] [--check] [--part all|prefill|decode]

Needs an SM90 GPU (H100 / H200 / H800 / H20). The decode step needs deep_indexer's FP4 decode (the paged
logits on an FP4 cache); a build without it runs the prefill chunk and then stops with a message
(`--part prefill` runs the prefill chunk alone).

The index formats it produces (int32; -1 marks an unused place, after the valid ones; entries in ascending
order):
  decode:  cache slots [B, next_n, k], slot = block_table[b, e // 64] * 64 + e % 64 for entry e, with the
           count topk_length [B], as FlashMLA's sparse decode takes them;
  prefill: rows [S, 1, k] of the batch's gathered compressed KV (its requests one after another), with the
           count per row [S], as FlashMLA's sparse prefill takes them; and the same selection as entry
           numbers within each sequence.
"""
from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass, field

import torch

import deep_indexer as di
from deep_indexer import quant

# ------------------------------------------------------------------------------------------ the model
RATIO = 4  # a CSA layer compresses every 4 tokens into one entry
INDEX_HEADS, INDEX_DIM = 64, 128  # the indexer's query heads and head dim (its keys: one 128-dim vector per entry)
BLOCK = 64  # compressed entries per cache block (= 256 tokens)
TOPK = {"V4-Flash": 512, "V4-Pro": 1024}
ATTN_HEADS, ATTN_DIM = 16, 512  # the sparse attention of this example: 16 query heads, one 512-dim entry (key = value)

# The requests of the example (token counts). Decode: tokens already processed by each request (its prompt
# and the tokens generated so far); their next token sees no entry yet (2), a first entry (3), a first full
# cache block (255), fewer entries than k (700), more than V4-Flash's k (2051: 513 entries), more than
# V4-Pro's k (4099: 1025 entries) and longer contexts.
DECODE_TOKENS = (2, 3, 255, 700, 2051, 4099, 9000, 17001)
# Prefill chunk: (tokens already processed, tokens in this chunk) per request: a first chunk, a later chunk
# of a long prompt, a chunk that starts inside a group of 4 tokens, and a chunk too short to see any entry.
PREFILL_CHUNKS = ((0, 1000), (6000, 600), (4097, 33), (0, 3))


# ------------------------------------------------------------------------------------------ the ratio-4 rule
def visible_entries(position):
    """How many compressed entries the token at `position` (0-based, int or tensor) sees.

    Entry e summarizes tokens 4e .. 4e + 3 and exists once token 4e + 3 has been processed, so the token at
    position p sees entries e < floor((p + 1) / 4): its own group's entry only when it completes that group.
    """
    return (position + 1) // RATIO


def entries_after(num_tokens):
    """Compressed entries of a sequence of `num_tokens` tokens (int or tensor): what its last token sees."""
    return num_tokens // RATIO


def new_entries(num_tokens: int, count: int) -> range:
    """The entries completed by appending `count` tokens to a sequence of `num_tokens`: the compressor emits
    them in this step, and they go into the cache before the indexer runs (the step's last tokens see them)."""
    return range(entries_after(num_tokens), entries_after(num_tokens + count))


# ------------------------------------------------------------------------------------------ the consumer formats
def selection_lengths(visible: torch.Tensor, k: int) -> torch.Tensor:
    """Selected entries per query row: all it sees, at most k (int32). The rest of the row is -1."""
    return visible.clamp(max=k).to(torch.int32)


def entries_to_slots(entries: torch.Tensor, block_table: torch.Tensor, seq_of_row: torch.Tensor,
                     block: int = BLOCK) -> torch.Tensor:
    """Entry numbers [R, k] (-1: none) of the sequences seq_of_row [R] -> cache slots
    block_table[seq, e // block] * block + e % block (int32, -1 kept): the decode kernels' format."""
    valid = entries >= 0
    e = entries.clamp(min=0).long()
    phys = block_table.long()[seq_of_row.long()[:, None], e // block]
    return torch.where(valid, phys * block + e % block, -1).to(torch.int32)


def entries_to_rows(entries: torch.Tensor, row_start: torch.Tensor) -> torch.Tensor:
    """Entry numbers [R, k] (-1: none) -> rows of the batch's concatenated compressed KV, where each row's
    sequence starts at row_start [R] (int32, -1 kept): the prefill kernels' format."""
    return torch.where(entries >= 0, entries + row_start[:, None].to(entries.dtype), -1).to(torch.int32)


def rows_to_entries(rows: torch.Tensor, row_start: torch.Tensor) -> torch.Tensor:
    """The inverse of entries_to_rows: entry numbers within each row's own sequence (-1 kept)."""
    return torch.where(rows >= 0, rows - row_start[:, None].to(rows.dtype), -1).to(torch.int32)


def selection_mask(entries: torch.Tensor, num_entries: int) -> torch.Tensor:
    """Entry numbers [R, k] (-1: none) -> bool [R, num_entries], True at the selected entries."""
    rows = torch.arange(entries.shape[0], device=entries.device)[:, None]
    mask = torch.zeros(entries.shape[0], num_entries + 1, dtype=torch.bool, device=entries.device)
    mask[rows, torch.where(entries >= 0, entries, num_entries)] = True  # -1 marks the extra last column
    return mask[:, :num_entries]


# ------------------------------------------------------------------------------------------ the paged caches
@dataclass
class Request:
    num_tokens: int = 0  # tokens processed so far
    blocks: list = field(default_factory=list)  # its physical cache blocks, in order
    # What the compressor produced for every entry, kept only to check against (--check): the indexer key
    # (before its FP4 cast) and the attention's compressed KV.
    index_keys: list = field(default_factory=list)
    attn_kv: list = field(default_factory=list)

    def truth(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.cat(self.index_keys) if self.index_keys else torch.zeros(0, INDEX_DIM, device=device)
        kv = torch.cat(self.attn_kv) if self.attn_kv else torch.zeros(0, ATTN_DIM, device=device)
        return keys, kv


class LayerCache:
    """One CSA layer's two paged caches, which share the block table (so a slot names the same entry in both):

    - the indexer cache, FP4: uint8 [num_blocks, 64, 1, 68]. Each block holds 64 keys of 128 values as
      64 x 64 bytes of e2m1 codes (two per byte), then 64 int32 scale words (four ue8m0 exponents, one per
      32 values); deep_indexer.quant writes and reads it (docs/fp4.md);
    - the attention's compressed KV: float32 [num_blocks, 64, 512] in this example.
    """

    def __init__(self, num_blocks: int, device):
        self.index = torch.zeros(num_blocks, BLOCK, 1, INDEX_DIM // 2 + 4, dtype=torch.uint8, device=device)
        self.attn = torch.zeros(num_blocks, BLOCK, ATTN_DIM, device=device)
        # Block 0 is never handed out: it pads the block table's unused columns. The others in shuffled
        # order, so that a sequence's blocks are scattered as in a long-running engine.
        self.free = list(range(1, num_blocks))
        random.Random(0).shuffle(self.free)
        self.device = device

    def grow(self, req: Request, num_entries: int) -> None:
        while len(req.blocks) * BLOCK < num_entries:
            req.blocks.append(self.free.pop())

    def block_table(self, reqs) -> torch.Tensor:
        """int32 [len(reqs), max blocks]: the physical block of every 64 entries of each request."""
        width = max(1, max(len(r.blocks) for r in reqs))
        rows = [r.blocks + [0] * (width - len(r.blocks)) for r in reqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def write(self, block_table, entry, keys, kv, seq_ids=None) -> None:
        """Store new entries: entry [T] (the entry number in its sequence; -1: nothing to store), their indexer
        keys [T, 128] (cast to FP4 by the writer) and compressed KV [T, 512]. seq_ids [T]: the block-table row
        of each (None: row t of the table, one per request, as in decode)."""
        # The indexer cache: cast and store in one call, no host synchronization (CUDA-graph capturable).
        quant.write_paged_kv_step(self.index, keys, block_table, entry, seq_ids=seq_ids, fmt="fp4")
        # The attention's cache, at the same slots (-1: skipped).
        slots = quant.paged_kv_slots(block_table, entry, BLOCK, seq_ids=seq_ids, num_blocks=self.index.shape[0])
        keep = slots >= 0
        self.attn.view(-1, ATTN_DIM)[slots[keep]] = kv[keep]

    def append_tokens(self, reqs, counts) -> None:
        """Process `counts[i]` more tokens of request i (a prefill chunk, or earlier steps): the compressor's new
        entries of every request, stored in one call (tokens of several sequences: seq_ids)."""
        seq_ids, entry = [], []
        for i, (r, c) in enumerate(zip(reqs, counts)):
            done = new_entries(r.num_tokens, c)
            self.grow(r, done.stop)
            seq_ids += [i] * len(done)
            entry += list(done)
        keys, kv = self.compressor(reqs, seq_ids)
        table = self.block_table(reqs)
        ids = torch.tensor(entry, dtype=torch.int64, device=self.device)
        self.write(table, ids, keys, kv, torch.tensor(seq_ids, dtype=torch.int64, device=self.device))
        for r, c in zip(reqs, counts):
            r.num_tokens += c

    def compressor(self, reqs, seq_ids):
        """Stand-in for the model's compressor: random keys (bf16, as the model's activations) and KV for new
        entries of requests seq_ids (one entry each, in order); remembered in the requests for the check."""
        n = len(seq_ids)
        keys = torch.randn(n, INDEX_DIM, device=self.device).bfloat16().float()
        kv = torch.randn(n, ATTN_DIM, device=self.device)
        for t, s in enumerate(seq_ids):
            reqs[s].index_keys.append(keys[t: t + 1])
            reqs[s].attn_kv.append(kv[t: t + 1])
        return keys, kv


def read_fp4_keys(index_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP4 keys at `slots` of the paged indexer cache, as the prefill op takes them:
    (codes uint8 [N, 64], scale words int32 [N]). A block is 64 x 64 code bytes, then 64 scale words."""
    nb, bkv, _, row = index_cache.shape
    half = row - 4
    flat = index_cache.view(nb, bkv * row)
    codes = flat[:, : bkv * half].view(nb, bkv, half)
    words = flat[:, bkv * half:].view(nb, bkv, 4)
    blk, off = slots // bkv, slots % bkv
    return codes[blk, off], words[blk, off].view(torch.int32).view(-1)


def random_queries(rows: int, device, next_n: int | None = None):
    """The indexer's inputs of `rows` query tokens (stand-ins for the model's): FP4 q (codes, scale words) of
    64 heads x 128 and float32 head weights [rows, 64]; [B, next_n, ...] for decode."""
    shape = (rows, INDEX_HEADS, INDEX_DIM) if next_n is None else (rows // next_n, next_n, INDEX_HEADS, INDEX_DIM)
    q = quant.per_token_cast_to_fp4(torch.randn(shape, device=device).bfloat16())
    weights = torch.randn(rows, INDEX_HEADS, device=device) * INDEX_HEADS ** -0.5
    return q, weights


# ------------------------------------------------------------------------------------------ decode
@dataclass
class DecodeStep:
    q: tuple
    weights: torch.Tensor
    visible: torch.Tensor  # int32 [B, next_n]: entries seen by each query row
    block_table: torch.Tensor
    schedule: torch.Tensor
    max_entries: int
    slots: torch.Tensor  # int32 [B, next_n, k]: cache slots of the selected entries, -1 padded
    topk_length: torch.Tensor  # int32 [B]: selected entries of each request's last row
    row_lengths: torch.Tensor  # int32 [B, next_n]


def decode_step(cache: LayerCache, reqs, next_n: int, k: int) -> DecodeStep:
    """One decode step: next_n new tokens per request (1, or 2 with one speculative token (MTP))."""
    dev = cache.device
    b = len(reqs)
    first = torch.tensor([r.num_tokens for r in reqs], device=dev)  # position of each request's first new token
    # 1. The compressor: next_n <= 4 new tokens complete at most one entry per request. The engine's decode
    # path has one row per request, entry -1 where nothing is new (skipped by the cache writer).
    before, after = entries_after(first), entries_after(first + next_n)
    entry = torch.where(after > before, before, -1)
    for r, n in zip(reqs, after.tolist()):
        cache.grow(r, n)
    table = cache.block_table(reqs)
    new = [i for i, e in enumerate(entry.tolist()) if e >= 0]
    keys = torch.zeros(b, INDEX_DIM, device=dev)
    kv = torch.zeros(b, ATTN_DIM, device=dev)
    if new:
        keys[new], kv[new] = cache.compressor(reqs, new)
    cache.write(table, entry, keys, kv)
    for r in reqs:
        r.num_tokens += next_n
    # 2. Entries seen by each query row: row i of a request is the token at first + i (ratio-4 rule).
    visible = visible_entries(first[:, None] + torch.arange(next_n, device=dev)).to(torch.int32)  # [B, next_n]
    # 3. The indexer: logits of every row over its request's entries in the FP4 cache, then the top k as
    # cache slots (block_table[b, e // 64] * 64 + e % 64), which the sparse decode attention reads. The
    # [B, next_n] form of the lengths gives every row its own count (the ratio-4 rule is not "one more
    # entry per row"). The engine knows an upper bound of the lengths on the host (here: the largest).
    q, weights = random_queries(b * next_n, dev, next_n)
    schedule = di.get_paged_mqa_logits_metadata(visible, BLOCK)
    max_entries = max(1, int(after.max()))
    workspace = di.topk_workspace(b * next_n, max_entries, device=dev)  # reused every step in an engine
    slots = di.fp8_paged_mqa_topk_indices(q, cache.index, weights, visible, table, schedule, max_entries, k,
                                          index_mode="slot", workspace=workspace)
    # 4. The formats of a sparse decode kernel: slots [B, next_n, k] (-1 padded), and how many are valid.
    # Per request (topk_length [B]) that is its last row's count; an earlier row of the request may see one
    # entry fewer, and its list then ends with one more -1.
    row_lengths = selection_lengths(visible, k)
    return DecodeStep(q, weights, visible, table, schedule, max_entries, slots.view(b, next_n, k),
                      row_lengths[:, -1].contiguous(), row_lengths)


# ------------------------------------------------------------------------------------------ prefill chunk
@dataclass
class PrefillChunk:
    q: tuple
    weights: torch.Tensor
    keys: tuple  # (codes [N, 64], scale words [N]): every entry of the batch's requests, request after request
    attn_kv: torch.Tensor  # [N, 512]: the same entries of the attention's compressed KV
    row_start: torch.Tensor  # int32 [S]: where each row's sequence starts among the N entries
    row_end: torch.Tensor  # int32 [S]: row_start + the entries the row sees
    rows: torch.Tensor  # int32 [S, 1, k]: selected rows of the N entries, -1 padded
    entries: torch.Tensor  # int32 [S, 1, k]: the same as entry numbers within each row's sequence
    lengths: torch.Tensor  # int32 [S]


def prefill_chunk(cache: LayerCache, reqs, chunk_tokens, k: int) -> PrefillChunk:
    """One chunk of prefill: chunk_tokens[i] new tokens of request i, all scored in one call."""
    dev = cache.device
    first = [r.num_tokens for r in reqs]
    # 1. The compressor's new entries (those completed inside the chunk), stored first: later tokens of the
    # chunk see them.
    cache.append_tokens(reqs, chunk_tokens)
    # 2. The prefill op reads contiguous keys: gather every request's entries (the earlier chunks' and this
    # one's) from the paged cache, one request after another. The attention's KV is gathered alike.
    table = cache.block_table(reqs)
    counts = [entries_after(r.num_tokens) for r in reqs]
    seq_ids = torch.repeat_interleave(torch.arange(len(reqs), device=dev), torch.tensor(counts, device=dev))
    entry = torch.cat([torch.arange(n, device=dev) for n in counts])
    slots = quant.paged_kv_slots(table, entry, BLOCK, seq_ids=seq_ids)
    keys = read_fp4_keys(cache.index, slots)
    attn_kv = cache.attn.view(-1, ATTN_DIM)[slots]
    # 3. One query row per chunk token. The row of the token at position p of request i sees the keys
    # start_i <= j < start_i + floor((p + 1) / 4) (start_i: where request i's entries begin).
    starts = [sum(counts[:i]) for i in range(len(reqs))]
    pos = torch.cat([torch.arange(f, f + c, device=dev) for f, c in zip(first, chunk_tokens)])
    row_start = torch.repeat_interleave(torch.tensor(starts, device=dev), torch.tensor(chunk_tokens, device=dev))
    row_end = row_start + visible_entries(pos)
    row_start, row_end = row_start.to(torch.int32), row_end.to(torch.int32)
    q, weights = random_queries(len(pos), dev)
    # 4. The indexer: logits and top k in one call (chunked over rows inside, no [S, N] logits buffer),
    # as row numbers of the N gathered entries ("absolute"), which the sparse prefill attention reads.
    rows = di.fp8_mqa_topk_indices(q, keys, weights, row_start, row_end, k, index_mode="absolute")
    # 5. The formats: [S, 1, k] rows (-1 padded) with the count per row; and the same selection as entry
    # numbers within each sequence, for a consumer that indexes each sequence's own compressed KV.
    lengths = selection_lengths(row_end - row_start, k)
    entries = rows_to_entries(rows, row_start)
    return PrefillChunk(q, weights, keys, attn_kv, row_start, row_end, rows.unsqueeze(1), entries.unsqueeze(1),
                        lengths)


# ------------------------------------------------------------------------------------------ the PyTorch reference
def reference_index_logits(q: tuple, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Indexer logits I[r, j] = sum_h w[r, h] relu(q[r, h] . k[j]) in float64 on the dequantized FP4 inputs.
    q: FP4 (codes [R, 64, 64], scale words [R, 64]); keys: float [N, 128] (cast to FP4 here, as the cache
    writer does). Returns [R, N]."""
    qd = quant.fp4_to_float(*q, dtype=torch.float64)
    kd = quant.fp4_to_float(*quant.per_token_cast_to_fp4(keys), dtype=torch.float64)
    w = weights.double()
    out = torch.empty(qd.shape[0], kd.shape[0], dtype=torch.float64, device=qd.device)
    for r0 in range(0, qd.shape[0], 64):
        s = torch.einsum("rhd,nd->rhn", qd[r0: r0 + 64], kd).relu_()
        out[r0: r0 + 64] = torch.einsum("rhn,rh->rn", s, w[r0: r0 + 64])
    return out


def topk_entries(logits: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: int) -> torch.Tensor:
    """The selection rule, in plain PyTorch: for every row r, the k largest of logits[r, lo[r]:hi[r]], equal values
    won by the smaller column; as entry numbers j - lo[r] in ascending order, -1 padded to k (int64 [R, k]).
    Entries outside [lo, hi) are ignored; those inside must be finite."""
    r, n = logits.shape
    cols = torch.arange(n, device=logits.device)
    inside = (cols >= lo[:, None]) & (cols < hi[:, None])
    width = min(k, n)
    # a stable sort keeps equal values in column order, so the smaller column comes first
    order = torch.sort(torch.where(inside, logits, float("-inf")), dim=1, descending=True, stable=True).indices
    count = inside.sum(1, keepdim=True).clamp(max=width)
    taken = torch.where(torch.arange(width, device=logits.device) < count, order[:, :width], n)
    taken = taken.sort(dim=1).values  # ascending column; n (nothing) last
    out = torch.full((r, k), -1, dtype=torch.int64, device=logits.device)
    out[:, :width] = torch.where(taken < n, taken - lo[:, None], -1)
    return out


def sparse_attention_with_sink(q, kv, index, sink, scale):
    """Attention of q [R, H, D] over the rows index [R, k] of kv [N, D] (key = value; -1: no entry), with a
    sink logit per head: softmax over [scores, sink[h]], the sink's share adds nothing. Returns [R, H, D]."""
    valid = index >= 0
    picked = kv[index.clamp(min=0)]  # [R, k, D]
    s = torch.einsum("rhd,rkd->rhk", q, picked) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    s = torch.cat([s, sink.view(1, -1, 1).expand(s.shape[0], -1, 1).to(s.dtype)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]
    return torch.einsum("rhk,rkd->rhd", p, picked)


def dense_attention_with_sink(q, kv, mask, sink, scale):
    """The same over every row of kv [N, D], restricted by mask [R, N] (True: the entry takes part)."""
    s = torch.einsum("rhd,nd->rhn", q, kv) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    s = torch.cat([s, sink.view(1, -1, 1).expand(s.shape[0], -1, 1).to(s.dtype)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]
    return torch.einsum("rhn,nd->rhd", p, kv)


# ------------------------------------------------------------------------------------------ the checks
LOGITS_REL_DIFF = 1e-5  # 1 - 2<x,y>/(|x|^2 + |y|^2) over a batch's valid logits
LOGITS_ELEM = 1e-3  # every valid logit within this fraction of its row's largest |logit|
ATTN_TOL = 1e-9  # sparse vs dense attention (float64), relative to the largest output


class Checker:
    def __init__(self):
        self.failures: list[str] = []

    def expect(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failures.append(what)
            print(f"  FAILED: {what}")
        return ok


def rel_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    den = float((x * x + y * y).sum())
    return 0.0 if den == 0 else 1 - 2 * float((x * y).sum()) / den


def check_selection(ck: Checker, what, got_logits, ref_logits, lo, hi, k) -> torch.Tensor:
    """The kernel's logits against the float64 reference; returns the rule (topk_entries) on the kernel's own
    logits, which the caller compares with the kernel's selection exactly. Also compares that set with the
    rule on the float64 logits: they may differ only by entries whose float64 values lie within
    2 x LOGITS_ELEM (of the row's largest |logit|) of the k-th largest, i.e. near-ties that rounding can swap."""
    inside = torch.isfinite(ref_logits)
    ck.expect(torch.equal(torch.isfinite(got_logits), inside), f"{what}: logits written outside the visible entries")
    d = rel_diff(got_logits[inside], ref_logits[inside])
    scale = ref_logits.masked_fill(~inside, 0).abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    err = ((got_logits.double() - ref_logits).abs() / scale).masked_fill(~inside, 0)
    emax = float(err.max()) if err.numel() else 0.0
    ck.expect(d < LOGITS_REL_DIFF and emax < LOGITS_ELEM,
              f"{what}: logits differ from the float64 reference (relative difference {d:.2e}, largest "
              f"element error {emax:.2e} of its row's largest logit)")
    mine = topk_entries(got_logits.float(), lo, hi, k)
    exact = topk_entries(ref_logits, lo, hi, k)
    differ = (exact != mine).any(1)  # both ascending: equal sets are equal rows
    bad = 0
    for r in differ.nonzero().flatten().tolist():
        row = ref_logits[r, int(lo[r]): int(hi[r])]
        a, b = set(mine[r][mine[r] >= 0].tolist()), set(exact[r][exact[r] >= 0].tolist())
        kth = float(row[list(b)].min())
        tol = 2 * LOGITS_ELEM * float(scale[r])
        bad += any(float(row[j]) < kth - tol for j in a - b) or any(float(row[j]) > kth + tol for j in b - a)
    ck.expect(bad == 0, f"{what}: {bad} rows select a clearly different set than the rule on the float64 logits")
    print(f"  check {what}: logits vs the float64 reference: relative difference {d:.1e}, largest error "
          f"{emax:.1e} of the row's largest; top-{k} vs the rule on the float64 logits: "
          f"{len(mine) - int(differ.sum())}/{len(mine)} rows the same set, {int(differ.sum()) - bad} near-tie swaps")
    return mine


def check_attention(ck: Checker, what, sparse_out, dense_out) -> None:
    diff = float((sparse_out - dense_out).abs().max()) if sparse_out.numel() else 0.0
    top = float(dense_out.abs().max()) if dense_out.numel() else 0.0
    ck.expect(diff <= ATTN_TOL * max(top, 1e-30),
              f"{what}: sparse attention differs from dense masked attention by {diff:.2e} (largest output {top:.2e})")
    print(f"  check {what}: sparse attention with sink over the selection vs dense masked attention: "
          f"largest difference {diff:.1e} (outputs up to {top:.2f})")


def attention_inputs(rows: int, device, seed: int):
    """Random attention queries [rows, 16, 512] and sink logits [16] (float64), softmax scale 1 / sqrt(512)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(rows, ATTN_HEADS, ATTN_DIM, device=device, dtype=torch.float64, generator=gen)
    sink = torch.randn(ATTN_HEADS, device=device, dtype=torch.float64, generator=gen)
    return q, sink, ATTN_DIM ** -0.5


def check_decode(ck: Checker, cache: LayerCache, reqs, step: DecodeStep, k: int) -> None:
    dev = cache.device
    b, next_n = step.visible.shape
    what = f"decode next_n={next_n}"
    rows = b * next_n
    # (4) The kernel's logits, and the float64 reference over each request's entries as the compressor made
    # them (not read back from the cache, so that the cache writes are checked too).
    got = di.fp8_paged_mqa_logits(step.q, cache.index, step.weights, step.visible, step.block_table, step.schedule,
                                  step.max_entries, clean_logits=True)
    ref = torch.full((rows, step.max_entries), float("-inf"), dtype=torch.float64, device=dev)
    truth = [r.truth(dev) for r in reqs]
    qc, qs = step.q
    for i, (keys, _) in enumerate(truth):
        sl = slice(i * next_n, (i + 1) * next_n)
        lg = reference_index_logits((qc[i], qs[i]), step.weights[sl], keys)
        cols = torch.arange(keys.shape[0], device=dev)
        ref[sl, : keys.shape[0]] = lg.masked_fill(cols[None, :] >= step.visible[i, :, None], float("-inf"))
    lo = torch.zeros(rows, dtype=torch.long, device=dev)
    hi = step.visible.reshape(-1).long()
    mine = check_selection(ck, what, got, ref, lo, hi, k)
    # The kernel's slots: exactly the rule's entries, through the block table.
    slots = step.slots.reshape(rows, k)
    seq = torch.arange(b, device=dev).repeat_interleave(next_n)
    bad = int((entries_to_slots(mine, step.block_table, seq) != slots).any(1).sum())
    ck.expect(bad == 0, f"{what}: {bad} rows' slots are not the block-table slots of the rule's top-{k} entries")
    ck.expect(torch.equal((slots >= 0).sum(1).to(torch.int32), step.row_lengths.reshape(-1)),
              f"{what}: valid slots per row != min(visible entries, k)")
    # (5) Sparse attention reading the attention cache at the kernel's slots, against dense attention over
    # each request's own entries, restricted to the rule's selection.
    qa, sink, scale = attention_inputs(rows, dev, 1)
    sparse = sparse_attention_with_sink(qa, cache.attn.view(-1, ATTN_DIM).double(), slots, sink, scale)
    dense = torch.empty_like(sparse)
    for i, (_, kv) in enumerate(truth):
        sl = slice(i * next_n, (i + 1) * next_n)
        mask = selection_mask(mine[sl], kv.shape[0])
        dense[sl] = dense_attention_with_sink(qa[sl], kv.double(), mask, sink, scale)
    check_attention(ck, what, sparse, dense)


def check_prefill(ck: Checker, reqs, chunk_tokens, step: PrefillChunk, k: int) -> None:
    dev = step.rows.device
    what = "prefill chunk"
    s, n = step.rows.shape[0], step.keys[0].shape[0]
    # (4) The kernel's logits over the gathered entries, and the float64 reference per request.
    got = di.fp8_mqa_logits(step.q, step.keys, step.weights, step.row_start, step.row_end, clean_logits=True)
    ref = torch.full((s, n), float("-inf"), dtype=torch.float64, device=dev)
    truth = [r.truth(dev) for r in reqs]
    qc, qs = step.q
    seen = step.row_end - step.row_start
    spans, r0, c0 = [], 0, 0  # (first row, end row, first entry, end entry) of each request
    for (keys, _), c in zip(truth, chunk_tokens):
        lg = reference_index_logits((qc[r0: r0 + c], qs[r0: r0 + c]), step.weights[r0: r0 + c], keys)
        cols = torch.arange(keys.shape[0], device=dev)
        ref[r0: r0 + c, c0: c0 + keys.shape[0]] = lg.masked_fill(cols[None, :] >= seen[r0: r0 + c, None],
                                                                 float("-inf"))
        spans.append((r0, r0 + c, c0, c0 + keys.shape[0]))
        r0, c0 = r0 + c, c0 + keys.shape[0]
    mine = check_selection(ck, what, got, ref, step.row_start.long(), step.row_end.long(), k)
    # The kernel's rows: exactly the rule's entries, offset by the start of each row's sequence.
    rows = step.rows.view(s, k)
    bad = int((entries_to_rows(mine, step.row_start) != rows).any(1).sum())
    ck.expect(bad == 0, f"{what}: {bad} rows' indices are not the rule's top-{k} entries plus the sequence's start")
    ck.expect(torch.equal(step.entries.view(s, k), mine.to(torch.int32)),
              f"{what}: the entry numbers are not the rule's top-{k} entries")
    ck.expect(torch.equal((rows >= 0).sum(1).to(torch.int32), step.lengths),
              f"{what}: valid rows per query row != min(visible entries, k)")
    # (5) Sparse attention reading the gathered KV at the kernel's rows, against dense attention over each
    # request's own entries, restricted to the rule's selection (in pieces of 64 query rows).
    qa, sink, scale = attention_inputs(s, dev, 2)
    kv_rows = step.attn_kv.double()
    sparse, dense = torch.empty_like(qa), torch.empty_like(qa)
    for (a, b, e0, e1), (_, kv) in zip(spans, truth):
        for t in range(a, b, 64):
            u = min(b, t + 64)
            sparse[t:u] = sparse_attention_with_sink(qa[t:u], kv_rows, rows[t:u], sink, scale)
            dense[t:u] = dense_attention_with_sink(qa[t:u], kv.double(), selection_mask(mine[t:u], e1 - e0), sink,
                                                   scale)
    check_attention(ck, what, sparse, dense)


# ------------------------------------------------------------------------------------------ main
def run(model: str = "V4-Flash", check: bool = False, part: str = "all", device="cuda",
        decode_tokens=DECODE_TOKENS, prefill_chunks=PREFILL_CHUNKS, seed: int = 0) -> list[str]:
    """Run the example's steps; returns the failed checks (empty: all passed, or no --check)."""
    torch.manual_seed(seed)
    k = TOPK[model]
    ck = Checker()
    print(f"DeepSeek-{model} CSA indexer: {INDEX_HEADS} heads x {INDEX_DIM}, one entry per {RATIO} tokens, "
          f"top-{k}; FP4 indexer cache of {BLOCK} entries ({BLOCK * RATIO} tokens) per block")
    need = sum(math.ceil((t + 8) / RATIO / BLOCK) for t in decode_tokens) + \
        sum(math.ceil((a + c) / RATIO / BLOCK) for a, c in prefill_chunks) + 1
    cache = LayerCache(need, device)

    if part in ("all", "prefill"):
        reqs = [Request() for _ in prefill_chunks]
        cache.append_tokens(reqs, [a for a, _ in prefill_chunks])  # earlier chunks: their entries are cached
        chunk_tokens = [c for _, c in prefill_chunks]
        step = prefill_chunk(cache, reqs, chunk_tokens, k)
        s = step.rows.shape[0]
        print(f"prefill chunk: {len(reqs)} requests, {s} query rows over {step.keys[0].shape[0]} compressed entries")
        print(f"  rows of the gathered entries {list(step.rows.shape)} int32 (-1 padded), per-row lengths "
              f"{list(step.lengths.shape)} ({int(step.lengths.min())} to {int(step.lengths.max())}); "
              f"as entry numbers within each sequence {list(step.entries.shape)}")
        if check:
            check_prefill(ck, reqs, chunk_tokens, step, k)

    if part in ("all", "decode"):
        reqs = [Request() for _ in decode_tokens]
        cache.append_tokens(reqs, list(decode_tokens))  # the prompts and tokens before this step
        for next_n in (1, 2):  # a plain step, then one with a speculative token (MTP)
            step = decode_step(cache, reqs, next_n, k)
            lens = step.topk_length.tolist()
            print(f"decode step, next_n = {next_n}: {len(reqs)} requests seeing {step.visible.min().item()} to "
                  f"{step.visible.max().item()} entries")
            print(f"  cache slots {list(step.slots.shape)} int32 (-1 padded), topk_length {lens}")
            if check:
                check_decode(ck, cache, reqs, step, k)
    if check and not ck.failures:
        print("all checks passed")
    return ck.failures


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pro", action="store_true", help="V4-Pro's k = 1024 (default: V4-Flash's 512)")
    p.add_argument("--check", action="store_true", help="compare with the plain PyTorch reference")
    p.add_argument("--part", choices=("all", "prefill", "decode"), default="all")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("this example needs an SM90 (Hopper) GPU")
    failures = run("V4-Pro" if a.pro else "V4-Flash", a.check, a.part, "cuda", seed=a.seed)
    if failures:
        raise SystemExit(f"{len(failures)} failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
