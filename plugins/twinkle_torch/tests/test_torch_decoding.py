"""The decode loop's pure parts: the cache (select, trim, join), seeds, sampling, stop strings."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch

from twinkle_core.data_format import SamplingParams
from twinkle_torch.cache import PreallocatedLayer
from twinkle_torch.randomness import RowRandomness, derive_seed
from twinkle_torch.sampling import TokenSampler
from twinkle_torch.stopping import StopStringMatcher


def test_preallocated_layer_selects_repeats_and_grows() -> None:
    layer = PreallocatedLayer(capacity=3)
    k = torch.arange(2 * 1 * 2 * 4, dtype=torch.float32).reshape(2, 1, 2, 4)
    keys, values = layer.update(k, k + 100)
    assert torch.equal(keys, k) and layer.get_seq_length() == 2
    layer.select(torch.tensor([1, 1, 0]), capacity=6)  # repeat row 1 twice, then row 0
    assert torch.equal(layer.keys, k[[1, 1, 0]])
    step = torch.full((3, 1, 1, 4), -1.0)
    for _ in range(5):  # past the capacity: it grows
        keys, values = layer.update(step, step)
    assert keys.shape == (3, 1, 7, 4) and torch.equal(keys[:, :, :2], k[[1, 1, 0]])
    assert torch.equal(values[:, :, 2:], step.expand(3, 1, 5, 4))
    layer.select(torch.tensor([2]))
    assert torch.equal(layer.keys[0, :, :2], k[0])


def test_preallocated_layer_trims_leading_columns() -> None:
    layer = PreallocatedLayer(capacity=8)
    k = torch.arange(2 * 1 * 5 * 2, dtype=torch.float32).reshape(2, 1, 5, 2)
    layer.update(k, -k)
    layer.select(torch.tensor([1]), start=3)  # row 1 without its first 3 columns
    assert layer.get_seq_length() == 2
    assert torch.equal(layer.keys, k[1:, :, 3:]) and torch.equal(layer.values, -k[1:, :, 3:])


def test_joined_layers_are_right_aligned_over_zeros() -> None:
    # running rows of 4 columns, new rows of 2 (the other way round too): both end at the last column
    for long_first in (True, False):
        a, b = PreallocatedLayer(capacity=4), PreallocatedLayer(capacity=2)
        ka = torch.full((1, 1, 4, 2), float("nan"))  # padding that must never be read as data
        ka[:, :, 1:] = 1.0
        kb = torch.full((2, 1, 2, 2), 2.0)
        a.update(ka, ka)
        b.update(kb, kb)
        first, second = (a, b) if long_first else (b, a)
        first.adopt(*first.joined(second, capacity=9))
        assert first.get_seq_length() == 4 and first.capacity == 9
        rows_long, rows_short = (slice(0, 1), slice(1, 3)) if long_first else (slice(2, 3), slice(0, 2))
        keys = first.keys
        assert torch.equal(keys[rows_short, :, 2:], kb) and torch.equal(
            keys[rows_short, :, :2], torch.zeros(2, 1, 2, 2)
        )
        assert torch.equal(keys[rows_long, :, 1:], ka[:, :, 1:])
        first.update(torch.zeros(3, 1, 1, 2), torch.zeros(3, 1, 1, 2))  # it keeps decoding in place
        assert first.get_seq_length() == 5


def test_derived_seeds() -> None:
    assert derive_seed(5, 0) == 5
    seeds = {derive_seed(s, i) for s in range(20) for i in range(20)}
    assert len(seeds) == 400  # no two (seed, sample) pairs share a stream


def test_seeded_rows_draw_their_own_stream() -> None:
    a = RowRandomness([1, None, 2])
    first = a.uniforms(torch.device("cpu"))
    a.select([0, 2])
    second = a.uniforms(torch.device("cpu"))
    b = RowRandomness([2])
    assert b.uniforms(torch.device("cpu"))[0] == first[2]
    assert b.uniforms(torch.device("cpu"))[0] == second[1]


@pytest.mark.parametrize("native", [False, True], ids=["topk", "native"])
def test_truncation_widens_candidates_for_flat_rows(native: bool) -> None:
    # one peaked row and one flat row: the flat row's nucleus needs most of the vocabulary
    vocab = 5000
    logits = torch.zeros(2, vocab)
    logits[0, 7] = 30.0
    sampler = TokenSampler(SamplingParams(top_p=0.9, logprobs=0), native=native)
    out = sampler(logits, uniforms=torch.tensor([0.5, 0.999]))
    assert out.tokens[0] == 7
    assert out.logprobs is not None
    # The flat row's tokens tie. The draw keeps them all (no token has mass above it), and the
    # native nucleus keeps them together as the draw does; the topk path cuts the tie at 90%.
    kept = vocab if native else math.ceil(0.9 * vocab)
    assert out.logprobs[1] == pytest.approx(-math.log(kept), abs=1e-3)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_p=0.9, logprobs=0),
        SamplingParams(top_p=0.7, temperature=0.6, logprobs=5),
        SamplingParams(top_p=0.95, min_p=0.2, logprobs=3),
    ],
    ids=["top-p", "top-p-alternatives", "top-p-min-p"],
)
def test_native_nucleus_log_probs_equal_the_topk_paths(params: SamplingParams) -> None:
    """Rows from peaked to nearly flat, no exact ties: both ways of finding the nucleus give the same
    draws (the draw does not depend on them) and the same log-probs."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(32, 8000, generator=g) * torch.linspace(0.5, 6.0, 32).unsqueeze(1)
    uniforms = torch.rand(32, generator=g)

    def redraw() -> Callable[[list[int]], torch.Tensor]:  # the same numbers for the rows drawn again
        again = torch.Generator().manual_seed(5)
        return lambda rows: torch.rand(len(rows), generator=again)

    fast = TokenSampler(params, native=True)(logits, uniforms=uniforms, redraw=redraw())
    slow = TokenSampler(params)(logits, uniforms=uniforms, redraw=redraw())
    assert torch.equal(fast.tokens, slow.tokens)
    assert fast.logprobs is not None and slow.logprobs is not None
    assert torch.allclose(fast.logprobs, slow.logprobs, atol=1e-5, rtol=0)
    if params.logprobs:
        assert fast.top_ids is not None and slow.top_ids is not None
        assert torch.equal(fast.top_ids, slow.top_ids)
        assert fast.top_logprobs is not None and slow.top_logprobs is not None
        finite = torch.isfinite(slow.top_logprobs)
        assert torch.equal(torch.isfinite(fast.top_logprobs), finite)
        assert torch.allclose(fast.top_logprobs[finite], slow.top_logprobs[finite], atol=1e-5, rtol=0)
        assert not bool(finite.all())  # some alternatives fall outside a nucleus: the test sees the cut


def test_min_p_and_top_k() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    out = TokenSampler(SamplingParams(min_p=0.2, logprobs=4))(logits, uniforms=torch.tensor([0.99]))
    assert out.top_logprobs is not None and out.top_ids is not None
    kept = torch.exp(out.top_logprobs[0])
    # min_p=0.2 of the top 0.5 is 0.1: 0.05 goes, the rest renormalise
    assert kept.tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0], abs=1e-6)
    out = TokenSampler(SamplingParams(top_k=1, logprobs=0))(logits, uniforms=torch.tensor([0.99]))
    assert out.tokens.tolist() == [0] and out.logprobs is not None and out.logprobs.tolist() == [0.0]


class _ByteTokenizer:
    """Decodes ids as UTF-8 bytes: a character may take several tokens."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_stop_string_matcher_across_partial_characters() -> None:
    text = "naïve café — end"
    data = list(text.encode())
    matcher = StopStringMatcher(_ByteTokenizer(), ("é —", "zzz"), rows=1)
    hits = [matcher.push(0, b) for b in data]
    first = next(i for i, h in enumerate(hits) if h is not None)
    assert hits[first] == ("é —", text.index("é —"))
    assert bytes(data[: first + 1]).decode().endswith("é —")
    assert matcher.final_text(data[: first + 1], "é —", hits[first][1], 0) == "naïve caf"


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_p=0.75), SamplingParams(top_p=0.75, logprobs=0), SamplingParams(top_k=2, logprobs=0)],
    ids=["top-p", "top-p-with-logprobs", "top-k"],
)
def test_top_p_samples_the_renormalised_nucleus(params: SamplingParams) -> None:
    torch.manual_seed(0)
    rows = 20000
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]])).expand(rows, 4)
    out = TokenSampler(params)(logits, uniforms=torch.rand(rows))
    counts = torch.bincount(out.tokens, minlength=4).float() / rows
    # the smallest set with mass >= 0.75, and the top 2, are {1, 3}: 0.5 and 0.3, renormalised
    assert counts.tolist() == pytest.approx([0.0, 0.625, 0.0, 0.375], abs=0.015)
    if out.logprobs is not None:
        assert set(torch.exp(out.logprobs).round(decimals=3).tolist()) == {0.625, 0.375}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_p=0.95, logprobs=5),
        SamplingParams(temperature=0.7, top_p=0.9, min_p=0.001, logprobs=3),
        SamplingParams(temperature=1.3, top_p=0.5, logprobs=0),
    ],
    ids=["top-p", "top-p-min-p", "top-p-no-top"],
)
def test_processed_logprobs_under_top_p_equal_a_full_sort(params: SamplingParams) -> None:
    # rows from peaked to nearly flat: some nuclei hold a handful of tokens, one most of the vocabulary
    torch.manual_seed(3)
    vocab = 6000
    logits = torch.randn(6, vocab) * torch.tensor([[8.0], [4.0], [2.0], [1.0], [0.3], [0.01]])
    out = TokenSampler(params)(logits, uniforms=torch.rand(6))
    scaled = logits / params.temperature
    probs = torch.softmax(scaled, dim=-1)
    sorted_p, sorted_ids = probs.sort(dim=-1, descending=True)
    keep = (sorted_p.cumsum(dim=-1) - sorted_p) < params.top_p
    if params.min_p:
        keep &= sorted_p >= params.min_p * sorted_p[:, :1]
    assert int(keep.sum(dim=-1).max()) > 1000  # the flat row's nucleus is wide: the search had to widen
    log_mass = torch.log(torch.where(keep, sorted_p, 0.0).sum(dim=-1))
    for r in range(6):
        token = int(out.tokens[r])
        assert token in sorted_ids[r][keep[r]].tolist()  # drawn from the nucleus
        assert out.logprobs is not None
        assert float(out.logprobs[r]) == pytest.approx(float(torch.log(probs[r, token]) - log_mass[r]), abs=1e-5)
        if params.logprobs:
            assert out.top_ids is not None and out.top_logprobs is not None
            n = params.logprobs
            assert out.top_ids[r].tolist() == sorted_ids[r, :n].tolist()
            want = torch.where(keep[r, :n], torch.log(sorted_p[r, :n]) - log_mass[r], -math.inf)
            assert out.top_logprobs[r].tolist() == pytest.approx(want.tolist(), abs=1e-5)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, logprobs=2),
        SamplingParams(temperature=0.7, top_p=0.9, logprobs=3),
        SamplingParams(temperature=1.3, top_p=0.5, min_p=0.01, logprobs=0, logprobs_mode="raw"),
        SamplingParams(temperature=0.0, logprobs=1),
    ],
    ids=["full", "top-p", "top-p-min-p-raw", "greedy"],
)
def test_the_workspace_changes_no_bit_and_no_result_refers_to_it(params: SamplingParams) -> None:
    """The sampler's passes written into reused buffers give the same bits as into fresh tensors,
    and a result stays what it was when the next step reuses the buffers."""
    from twinkle_torch.sampling import FRESH_PAGES_BYTES, Workspace

    torch.manual_seed(4)
    # peaked rows (the drawn token alone fills the nucleus) and flat ones (the pass over the vocabulary runs)
    steps = [torch.randn(rows, 3000) * torch.linspace(0.05, 6.0, rows).unsqueeze(-1) for rows in (9, 5, 9)]
    uniforms = [torch.rand(len(logits)) for logits in steps]
    sampler, workspace = TokenSampler(params), Workspace(min_bytes=0)  # keep even these small passes

    def redraw(rows: list[int]) -> torch.Tensor:  # rejected draws: numbers of their own, the same in both runs
        return torch.tensor([(0.618 * (r + 1)) % 1.0 for r in rows])

    fresh = [sampler(logits, uniforms=u, redraw=redraw) for logits, u in zip(steps, uniforms)]
    reused = [sampler(logits, uniforms=u, redraw=redraw, workspace=workspace) for logits, u in zip(steps, uniforms)]
    for a, b in zip(fresh, reused):  # every step compared after all three ran: none was overwritten
        for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or torch.equal(x, y), name
    assert workspace._buffers  # every case here writes into it
    workspace.clear()
    assert not workspace._buffers
    small = Workspace()  # the default keeps only blocks the allocator would map afresh
    assert sampler(steps[0], uniforms=uniforms[0], redraw=redraw, workspace=small).tokens.equal(fresh[0].tokens)
    assert not small._buffers
    big = torch.empty(FRESH_PAGES_BYTES // 4, dtype=torch.float32)
    assert small.take("probs", big).numel() == big.numel() and small._buffers


def test_gather_prefills_right_aligns_rows_from_several_caches() -> None:
    from transformers import LlamaConfig

    from twinkle_torch.cache import gather_prefills, make_cache

    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=8)
    parts = []
    for width, rows, value in ((5, 2, 1.0), (3, 1, 2.0)):  # two prefills, 5 and 3 columns wide
        cache = make_cache(config, width)
        for layer in range(2):
            k = torch.full((rows, 1, width, 4), value) + torch.arange(rows).view(rows, 1, 1, 1) * 10 + layer
            cache.update(k, -k, layer)
        parts.append(cache)
    # the first prefill's row 1 twice, then the second's row 0, then the first's row 0
    gathered = gather_prefills(
        config,
        [
            (parts[0], torch.tensor([1, 1, 0]), torch.tensor([0, 1, 3])),
            (parts[1], torch.tensor([0]), torch.tensor([2])),
        ],
        rows=4,
        width=5,
        capacity=9,
    )
    for layer in range(2):
        keys = gathered.layers[layer].keys
        values = gathered.layers[layer].values
        assert keys.shape == (4, 1, 5, 4) and gathered.layers[layer].capacity == 9
        assert torch.equal(keys[0], parts[0].layers[layer].keys[1]) and torch.equal(keys[1], keys[0])
        assert torch.equal(keys[3], parts[0].layers[layer].keys[0])
        assert torch.equal(keys[2, :, 2:], parts[1].layers[layer].keys[0]) and not keys[2, :, :2].any()
        assert torch.equal(values, -keys)
    gathered.update(torch.ones(4, 1, 1, 4), torch.ones(4, 1, 1, 4), 0)  # it decodes in place
    assert gathered.get_seq_length() == 6


def test_a_new_caches_layers_each_keep_their_own_states() -> None:
    # a cache's layers take buffers allocated together at the first layer's update;
    # a layer of other shapes (or dtype) than the first gets its own
    from transformers import LlamaConfig

    from twinkle_torch.cache import make_cache

    config = LlamaConfig(num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, hidden_size=8)
    cache = make_cache(config, 6)
    shapes = [(2, 1, 3, 4), (2, 1, 3, 4), (2, 2, 3, 8), (2, 1, 3, 4)]
    dtypes = [torch.float32, torch.float32, torch.float32, torch.float64]
    states = [torch.randn(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes)]
    for layer, k in enumerate(states):
        keys, values = cache.update(k, -k, layer)
        assert torch.equal(keys, k) and torch.equal(values, -k)
    for _ in range(2):  # decode steps write in place, past the prefill, each layer into its own buffers
        steps = [torch.randn(k.shape[0], k.shape[1], 1, k.shape[3], dtype=k.dtype) for k in states]
        for layer, step in enumerate(steps):
            cache.update(step, 2 * step, layer)
        states = [torch.cat([k, step], dim=2) for k, step in zip(states, steps)]
    for layer, k in enumerate(states):
        assert torch.equal(cache.layers[layer].keys, k) and cache.layers[layer].capacity == 6
        assert torch.equal(cache.layers[layer].values[:, :, :3], -k[:, :, :3])
    buffers = [t.data_ptr() for layer in cache.layers for t in (layer._k, layer._v)]
    assert len(set(buffers)) == len(buffers)


def test_buffers_reserved_for_a_layer_that_never_writes_are_freed_at_the_next_forward() -> None:
    from transformers import LlamaConfig

    from twinkle_torch.cache import make_cache

    config = LlamaConfig(num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, hidden_size=8)
    cache = make_cache(config, 4)
    k = torch.randn(1, 1, 2, 4)
    for layer in range(2):  # layer 2 never writes (as a layer that reads another's cache)
        cache.update(k, k, layer)
    reservation = cache.layers[0]._reservation
    assert reservation is not None and len(reservation.spare) == 1  # layer 2's, held for this forward only
    keys, _ = cache.update(k[:, :, :1], k[:, :, :1], 0)  # the next forward
    assert not reservation.spare and torch.equal(keys, torch.cat([k, k[:, :, :1]], dim=2))


def test_attention_row_blocks_skip_only_columns_their_rows_mask() -> None:
    from twinkle_torch.attention import row_blocks

    rows, columns = 64, 100
    first = torch.cat([torch.full((32,), 5), torch.full((32,), 70)])  # long prompts, then short ones
    mask = (torch.arange(columns).unsqueeze(0) >= first.unsqueeze(1)).view(rows, 1, 1, columns)
    blocks = row_blocks(mask)
    assert blocks is not None and row_blocks(mask) is blocks  # one split per mask (every layer of a step)
    assert blocks[0][0] == 0 and blocks[-1][1] == rows and all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
    for a, b, start in blocks:
        assert start <= int(first[a:b].min())  # no row loses a column it attends to
    assert sum((b - a) * (columns - start) for a, b, start in blocks) < 0.7 * rows * columns
    # nothing to skip, or too few rows: one call
    assert row_blocks(torch.ones(rows, 1, 1, columns, dtype=torch.bool)) is None
    assert row_blocks(mask[:16]) is None


@pytest.mark.parametrize("value_dim", [32, 48])  # 48: values wider than keys, as multi-head latent attention has
@pytest.mark.parametrize("native", [False, True])
def test_grouped_decode_attention_equals_plain_attention(value_dim: int, native: bool) -> None:
    """Decode attention of grouped heads, in row blocks or not, through SDPA or the native kernel: plain math."""
    from twinkle_torch.attention import grouped_sdpa_attention_forward, row_blocks

    rows, heads, kv_heads, columns, dim = 64, 6, 2, 100, 32
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(rows, heads, 1, dim, generator=gen)
    key = torch.randn(rows, kv_heads, columns, dim, generator=gen)
    value = torch.randn(rows, kv_heads, columns, value_dim, generator=gen)
    first = torch.cat([torch.full((32,), 5), torch.full((32,), 70)])
    mask = (torch.arange(columns).unsqueeze(0) >= first.unsqueeze(1)).view(rows, 1, 1, columns)
    assert row_blocks(mask) is not None  # the SDPA path runs in blocks
    out, _ = grouped_sdpa_attention_forward(torch.nn.Module(), query, key, value, mask, scaling=0.2, native=native)
    group = heads // kv_heads
    scores = (query @ key.repeat_interleave(group, dim=1).transpose(-1, -2)) * 0.2
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    want = (weights @ value.repeat_interleave(group, dim=1)).transpose(1, 2)  # [rows, 1, heads, value_dim]
    assert out.shape == want.shape
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
