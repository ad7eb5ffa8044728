"""GPU correctness suite (needs an SM90 GPU; skipped cleanly otherwise).

Every kernel is compared with deep_indexer.reference on the dequantized inputs: fp32 logits to a
relative diff < 1e-5, bf16 logits < 1e-3, -inf masks identical, outputs poisoned before the run.
"""
import pytest
import torch

from conftest import requires_sm90

pytestmark = [requires_sm90, pytest.mark.gpu]

import deep_indexer as di  # noqa: E402
from deep_indexer import reference  # noqa: E402

DEV = "cuda"


# ------------------------------------------------------------------------------------ clean_logits
def _random_ranges(groups: int, n: int, gen: torch.Generator):
    ks = torch.randint(-n // 4, n + 3, (groups,), generator=gen, dtype=torch.int32)
    ke = ks + torch.randint(-n // 4, n + 3, (groups,), generator=gen, dtype=torch.int32)
    return ks, ke


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
@pytest.mark.parametrize("with_ks", [True, False])
@pytest.mark.parametrize("m,n,pad", [(8, 1, 0), (12, 7, 1), (36, 131, 3), (64, 4099, 5), (24, 65536, 0)])
def test_clean_logits(dtype, next_n, with_ks, m, n, pad):
    m = m // next_n * next_n
    gen = torch.Generator().manual_seed(m * 1000 + n + next_n)
    ks, ke = _random_ranges(m // next_n, n, gen)
    base = torch.randn(m, n + pad, generator=gen).to(dtype)
    expected = reference.clean_logits(base.clone()[:, :n], ks if with_ks else None, ke, next_n)
    buf = base.to(DEV)
    view = buf[:, :n]  # padded rows: the padding must stay untouched
    out = di.clean_logits(view, ks.to(DEV) if with_ks else None, ke.to(DEV), next_n)
    assert out.data_ptr() == view.data_ptr()
    torch.testing.assert_close(view.cpu(), expected, rtol=0, atol=0, equal_nan=False)
    if pad:
        assert torch.equal(buf[:, n:].cpu(), base[:, n:])


def test_clean_logits_empty_and_misaligned():
    gen = torch.Generator().manual_seed(7)
    di.clean_logits(torch.empty(0, 5, device=DEV), None, torch.empty(0, dtype=torch.int32, device=DEV))
    # bf16 rows starting at odd 2-byte offsets (stride 133): exercises scalar head/tail paths
    base = torch.randn(16, 133, generator=gen).to(torch.bfloat16)
    ks, ke = _random_ranges(16, 131, gen)
    expected = reference.clean_logits(base.clone()[:, 1:132], ks, ke, 1)
    dev = base.to(DEV)
    di.clean_logits(dev[:, 1:132], ks.to(DEV), ke.to(DEV), 1)
    assert torch.equal(dev[:, 1:132].cpu(), expected)
    assert torch.equal(dev[:, 0].cpu(), base[:, 0]) and torch.equal(dev[:, 132].cpu(), base[:, 132])


def test_clean_logits_rejects_bad_inputs():
    x = torch.randn(4, 8, device=DEV)
    ke = torch.full((4,), 3, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="cu_seq_len_k_end must have dtype"):
        di.clean_logits(x, None, ke.long())
    with pytest.raises(ValueError, match="must be on cuda:0"):
        di.clean_logits(x, None, ke.cpu())
    with pytest.raises(ValueError, match="next_n"):
        di.clean_logits(x, None, ke, 3)
