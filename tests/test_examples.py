"""examples/v4_csa_indexer.py (the DeepSeek-V4 CSA indexer step): its pure-PyTorch parts on the CPU (the ratio-4
rule, the index formats against deep_indexer.reference, the FP4 cache reads, the sparse attention with sink), the
whole example on the CPU with deep_indexer's GPU ops replaced by deep_indexer.reference (its checks pass, and
fail on a wrong selection, slot, logit or cache write), and on an SM90 GPU the example itself with --check."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types

import pytest
import torch

from conftest import HAS_SM90, requires_sm90

from deep_indexer import quant, reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "v4_csa_indexer.py")


def _load():
    spec = importlib.util.spec_from_file_location("v4_csa_indexer", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


ex = _load()


# ------------------------------------------------------------------------------------ the ratio-4 rule
def test_visible_entries_is_the_ratio_4_rule():
    # entry e covers tokens 4e .. 4e + 3 and is visible to token p once its last token is processed: 4e + 3 <= p
    for p in range(0, 1100):
        brute = sum(1 for e in range(300) if 4 * e + 3 <= p)
        assert ex.visible_entries(p) == brute, p
        assert ex.entries_after(p + 1) == brute
    pos = torch.arange(0, 1100)
    assert torch.equal(ex.visible_entries(pos), torch.tensor([ex.visible_entries(int(p)) for p in pos]))
    assert ex.visible_entries(0) == ex.visible_entries(2) == 0 and ex.visible_entries(3) == 1
    assert ex.visible_entries(255) == 64 and ex.visible_entries(254) == 63  # a full cache block after 256 tokens


@pytest.mark.parametrize("chunks", [[1] * 40, [3, 1, 4, 1, 5, 9, 2, 6], [7, 0, 257, 1, 2, 3], [1000]])
def test_new_entries_of_successive_steps_are_each_entry_once(chunks):
    done, n = [], 0
    for c in chunks:
        r = ex.new_entries(n, c)
        # what the step's last token sees, and nothing its first token could not yet see is missing
        assert r.stop == ex.visible_entries(n + c - 1) if c else r.stop == r.start
        done += list(r)
        n += c
    assert done == list(range(n // 4))


# ------------------------------------------------------------------------------------ the index formats
def _logits(rows, cols, gen, ties=False):
    x = torch.randn(rows, cols, generator=gen)
    return (x * 2).round() / 2 if ties else x  # ties: many equal values, so the tie rule decides


@pytest.mark.parametrize("ties", [False, True])
def test_topk_entries_is_deep_indexers_rule(ties):
    gen = torch.Generator().manual_seed(3)
    lg = _logits(40, 300, gen, ties)
    ks = torch.randint(0, 150, (40,), generator=gen, dtype=torch.int32)
    ke = (ks + torch.randint(0, 160, (40,), generator=gen, dtype=torch.int32)).clamp(max=300)
    for k in (1, 7, 64, 200):
        got = ex.topk_entries(lg, ks.long(), ke.long(), k)
        want = reference.topk_indices(lg, k, ks, ke)  # relative, ascending, -1 padded: the documented rule
        assert torch.equal(got, want.long()), k


@pytest.mark.parametrize("next_n", [1, 2])
def test_slots_are_deep_indexers_slot_mode(next_n):
    """entries_to_slots of the rule's entries == reference.topk_indices(index_mode="slot") on a scattered table."""
    gen = torch.Generator().manual_seed(next_n)
    b, k, block = 6, 48, 64
    tokens = torch.tensor([2, 3, 255, 700, 2051, 1000])
    ctx = ex.visible_entries(tokens[:, None] + torch.arange(next_n)).to(torch.int32)  # [B, next_n]
    width = int(ctx.max()) // block + 1
    table = torch.randperm(b * width + 5, generator=gen)[: b * width].view(b, width).to(torch.int32)
    lg = _logits(b * next_n, int(ctx.max()) + 3, gen)
    want = reference.topk_indices(lg, k, context_lens=ctx, next_n=next_n, index_mode="slot", block_table=table,
                                  block_size=block)
    hi = ctx.reshape(-1).long()
    entries = ex.topk_entries(lg, torch.zeros_like(hi), hi, k)
    seq = torch.arange(b).repeat_interleave(next_n)
    got = ex.entries_to_slots(entries, table, seq, block)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert torch.equal((got >= 0).sum(1).to(torch.int32), ex.selection_lengths(ctx, k).reshape(-1))
    # a wrong block table gives other slots
    assert not torch.equal(ex.entries_to_slots(entries, table.roll(1, 0), seq, block), want)


def test_rows_are_deep_indexers_absolute_mode():
    gen = torch.Generator().manual_seed(5)
    counts, chunk = [250, 1650, 1032, 0], [30, 20, 9, 3]  # entries per request, query rows per request
    starts = torch.tensor([0, 250, 1900, 2932])
    row_start = starts.repeat_interleave(torch.tensor(chunk)).to(torch.int32)
    seen = torch.cat([torch.randint(0, max(n, 1), (c,), generator=gen) for n, c in zip(counts, chunk)])
    seen[-3:] = 0
    row_end = (row_start + seen).to(torch.int32)
    lg = _logits(row_start.numel(), sum(counts), gen)
    k = 128
    want = reference.topk_indices(lg, k, row_start, row_end, index_mode="absolute")
    entries = ex.topk_entries(lg, row_start.long(), row_end.long(), k)
    rows = ex.entries_to_rows(entries, row_start)
    assert rows.dtype == torch.int32 and torch.equal(rows, want)
    assert torch.equal(ex.rows_to_entries(rows, row_start), entries.to(torch.int32))
    assert torch.equal(ex.rows_to_entries(rows, row_start), reference.topk_indices(lg, k, row_start, row_end))
    assert torch.equal((rows >= 0).sum(1).to(torch.int32), ex.selection_lengths(row_end - row_start, k))


def test_selection_mask():
    e = torch.tensor([[0, 3, -1, -1], [-1, -1, -1, -1], [4, 1, 2, 0]])
    m = ex.selection_mask(e, 5)
    assert m.tolist() == [[True, False, False, True, False], [False] * 5, [True, True, True, False, True]]


# ------------------------------------------------------------------------------------ the FP4 cache
def test_cache_writes_and_reads_the_fp4_keys():
    """LayerCache.append_tokens (write_paged_kv_step over scattered blocks) and read_fp4_keys give back every
    entry's FP4 cast; the attention cache holds the same entries at the same slots."""
    torch.manual_seed(0)
    cache = ex.LayerCache(40, "cpu")
    reqs = [ex.Request() for _ in range(3)]
    for counts in ([5, 0, 300], [1000, 3, 1], [1, 1, 1], [2, 600, 0]):  # steps of several requests at once
        cache.append_tokens(reqs, counts)
    table = cache.block_table(reqs)
    assert int(table.min()) >= 0 and 0 not in sum((r.blocks for r in reqs), [])  # block 0 only pads
    for i, r in enumerate(reqs):
        n = ex.entries_after(r.num_tokens)
        keys, kv = r.truth("cpu")
        assert keys.shape == (n, ex.INDEX_DIM) and kv.shape == (n, ex.ATTN_DIM)
        slots = quant.paged_kv_slots(table, torch.arange(n), ex.BLOCK, seq_ids=torch.full((n,), i))
        codes, sf = ex.read_fp4_keys(cache.index, slots)
        want_codes, want_sf = quant.per_token_cast_to_fp4(keys)
        assert torch.equal(codes, want_codes) and torch.equal(sf, want_sf)
        assert torch.equal(cache.attn.view(-1, ex.ATTN_DIM)[slots], kv)


# ------------------------------------------------------------------------------------ sparse attention with sink
def _attention_case(gen, rows=12, heads=4, d=32, n=50, k=16):
    q = torch.randn(rows, heads, d, generator=gen, dtype=torch.float64)
    kv = torch.randn(n, d, generator=gen, dtype=torch.float64)
    sink = torch.randn(heads, generator=gen, dtype=torch.float64)
    idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(rows)])
    idx[1, 5:] = -1  # a short row
    idx[2] = -1  # a row with nothing selected
    mask = ex.selection_mask(idx, n)
    return q, kv, sink, idx, mask


def test_sparse_attention_with_sink_equals_dense_masked():
    gen = torch.Generator().manual_seed(7)
    q, kv, sink, idx, mask = _attention_case(gen)
    scale = 32 ** -0.5
    sparse = ex.sparse_attention_with_sink(q, kv, idx, sink, scale)
    dense = ex.dense_attention_with_sink(q, kv, mask, sink, scale)
    assert float((sparse - dense).abs().max()) < 1e-12
    assert float(sparse[2].abs().max()) == 0  # only the sink: no value
    # the padding's position does not matter
    perm = torch.randperm(idx.shape[1], generator=gen)
    assert float((ex.sparse_attention_with_sink(q, kv, idx[:, perm], sink, scale) - dense).abs().max()) < 1e-12
    # one other entry, or one entry fewer, changes the result
    wrong = idx.clone()
    wrong[0, 0] = int(torch.nonzero(~mask[0])[0])
    assert float((ex.sparse_attention_with_sink(q, kv, wrong, sink, scale) - dense)[0].abs().max()) > 1e-6
    fewer = idx.clone()
    fewer[3, 0] = -1
    assert float((ex.sparse_attention_with_sink(q, kv, fewer, sink, scale) - dense)[3].abs().max()) > 1e-6


def test_the_sink_takes_mass_and_no_value():
    gen = torch.Generator().manual_seed(8)
    q, kv, sink, idx, mask = _attention_case(gen)
    scale = 32 ** -0.5
    some = mask.any(1)  # rows with at least one entry (row 2 has none: without a sink it is 0 / 0)
    # sink -inf: ordinary softmax attention over the selected entries
    plain = ex.sparse_attention_with_sink(q, kv, idx, torch.full_like(sink, float("-inf")), scale)
    s = torch.einsum("rhd,nd->rhn", q, kv).mul(scale).masked_fill(~mask[:, None], float("-inf"))
    want = torch.einsum("rhn,nd->rhd", torch.softmax(s, -1), kv)
    assert float((plain - want)[some].abs().max()) < 1e-12
    # with a sink: that output times the selected entries' share e^lse / (e^lse + e^sink); 0 for an empty row
    with_sink = ex.sparse_attention_with_sink(q, kv, idx, sink, scale)
    keep = torch.sigmoid(torch.logsumexp(s, -1) - sink)  # [R, H]
    assert float((with_sink - want * keep[..., None])[some].abs().max()) < 1e-12
    assert float(with_sink[~some].abs().max()) == 0
    assert float(keep[some].max()) < 1  # the sink took some of the mass


# ------------------------------------------------------------------------------------ the whole example on the CPU
SMALL = dict(decode_tokens=(2, 3, 255, 300, 517), prefill_chunks=((0, 150), (600, 50), (5, 2), (0, 3)))


def _reference_ops(corrupt=None):
    """deep_indexer's ops as the example calls them, computed by deep_indexer.reference (plain PyTorch, CPU);
    corrupt(name, tensor) may alter a result."""
    bad = corrupt or (lambda name, t: t)

    def paged_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                     clean_logits=False):
        lg = reference.paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len)
        return bad("paged_logits", lg)

    def paged_topk(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, k, *,
                   index_mode="relative", workspace=None):
        lg = reference.paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len)
        idx = reference.topk_indices(lg, k, context_lens=context_lens, next_n=q[0].shape[1], index_mode=index_mode,
                                     block_table=block_table, block_size=kv_cache.shape[1])
        return bad("paged_topk", idx)

    def mqa_logits(q, kv, weights, ks, ke, clean_logits=False):
        return bad("mqa_logits", reference.mqa_logits(q, kv, weights, ks, ke))

    def mqa_topk(q, kv, weights, ks, ke, k, *, index_mode="relative"):
        idx = reference.topk_indices(reference.mqa_logits(q, kv, weights, ks, ke), k, ks, ke, index_mode=index_mode)
        return bad("mqa_topk", idx)

    return types.SimpleNamespace(
        get_paged_mqa_logits_metadata=lambda context_lens, block_kv: None,
        topk_workspace=lambda rows, cols, device=None: None,
        fp8_paged_mqa_logits=paged_logits, fp8_paged_mqa_topk_indices=paged_topk,
        fp8_mqa_logits=mqa_logits, fp8_mqa_topk_indices=mqa_topk)


@pytest.fixture
def cpu_example(monkeypatch):
    monkeypatch.setitem(ex.TOPK, "small", 32)

    def run(corrupt=None, part="all", quant_module=None):
        monkeypatch.setattr(ex, "di", _reference_ops(corrupt))
        if quant_module is not None:
            monkeypatch.setattr(ex, "quant", quant_module)
        return ex.run("small", True, part, "cpu", **SMALL)
    return run


def test_example_runs_and_checks_on_the_cpu(cpu_example, capsys):
    assert cpu_example() == []
    out = capsys.readouterr().out
    assert "all checks passed" in out
    for what in ("prefill chunk", "decode next_n=1", "decode next_n=2"):
        assert f"check {what}: logits" in out and f"check {what}: sparse attention" in out
    assert "topk_length [0, 1, 32, 32, 32]" in out  # no entry yet, a first entry, more than k


def _first_full_row(idx):
    return int(((idx >= 0).sum(1) == idx.shape[1]).nonzero()[0])


def _bump_one(name_wanted):
    def corrupt(name, t):
        if name == name_wanted:
            t = t.clone()
            t[_first_full_row(t), 3] += 1  # one index to its neighbour
        return t
    return corrupt


def _scale_logits(name_wanted):
    def corrupt(name, t):
        if name == name_wanted:
            t = t.clone()
            t[t.shape[0] // 2, :] *= 1.01
        return t
    return corrupt


@pytest.mark.parametrize("corrupt, part, message", [
    (_bump_one("paged_topk"), "decode", "slots are not the block-table slots"),
    (_bump_one("mqa_topk"), "prefill", "indices are not the rule's top-32 entries"),
    (_scale_logits("paged_logits"), "decode", "logits differ from the float64 reference"),
    (_scale_logits("mqa_logits"), "prefill", "logits differ from the float64 reference"),
])
def test_example_check_fails_on_a_wrong_result(cpu_example, capsys, corrupt, part, message):
    failures = cpu_example(corrupt, part)
    assert failures and any(message in f for f in failures), failures
    assert "all checks passed" not in capsys.readouterr().out


def test_example_check_fails_on_a_misplaced_cache_write(cpu_example):
    """A cache writer that puts the indexer keys one entry too far: the kernel reads the cache, the reference
    reads the compressor's outputs, so the logits differ."""
    def shifted(kv_cache, k, block_table, positions, *, seq_ids=None, fmt="fp8"):
        return quant.write_paged_kv_step(kv_cache, k, block_table, torch.where(positions >= 0, positions + 1, -1),
                                         seq_ids=seq_ids, fmt=fmt)
    fake = types.SimpleNamespace(**{n: getattr(quant, n) for n in quant.__all__})
    fake.write_paged_kv_step = shifted
    failures = cpu_example(part="decode", quant_module=fake)
    assert any("logits differ from the float64 reference" in f for f in failures), failures


@pytest.mark.skipif(HAS_SM90, reason="checks the message shown without an SM90 GPU")
def test_example_needs_an_sm90_gpu():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, EXAMPLE, "--check"], capture_output=True, text=True, timeout=300, env=env)
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    assert r.returncode == 1 and last == "this example needs an SM90 (Hopper) GPU", r.stderr


# ------------------------------------------------------------------------------------ on an SM90 GPU
def _run_example(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, EXAMPLE, "--check", *args], capture_output=True, text=True, timeout=1800,
                       env=env)
    assert r.returncode == 0 and "all checks passed" in r.stdout, r.stdout + r.stderr
    return r.stdout


@requires_sm90
@pytest.mark.parametrize("model", [[], ["--pro"]], ids=["flash", "pro"])
def test_example_prefill_on_gpu(model):
    out = _run_example("--part", "prefill", *model)
    assert "check prefill chunk: sparse attention" in out


@requires_sm90
@pytest.mark.parametrize("model", [[], ["--pro"]], ids=["flash", "pro"])
def test_example_decode_on_gpu(model):
    out = _run_example("--part", "decode", *model)
    assert "check decode next_n=2: sparse attention" in out
