"""Every lane's attention at a layer in one call (`dots.attention_lanes`, issue 57): each lane gets the bits of its own
call (`dots.attention`), whatever the other lanes hold, at any thread count.

The checks can fail: a task that reads another lane's keys or values, writes into another lane's output or scores
on a row of another lane's length gives other bits (the lanes' keys are drawn apart, and the equal-length case is the
one where a lane that read its neighbour's keys would run without going out of bounds).
"""

import pytest
import torch

from kvdirect_app.kernels import dots

pytestmark = pytest.mark.skipif(dots.unavailable() is not None, reason=str(dots.unavailable()))


def _lanes(lengths, heads=9, kv_heads=3, d=64, dtype=torch.float32, seed=0, strided=False):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(len(lengths), heads, 1, d, generator=gen).to(dtype)
    keys, values = [], []
    for t in lengths:
        k = torch.randn(kv_heads, t, d, generator=gen).to(dtype)
        v = torch.randn(kv_heads, t, d, generator=gen).to(dtype)
        if strided:  # a view into a wider buffer, as a cache layer's kept window may hand attention
            k = torch.cat([k, torch.zeros(kv_heads, 3, d, dtype=dtype)], dim=1)[:, :t]
            v = torch.cat([torch.zeros(kv_heads, 2, d, dtype=dtype), v], dim=1)[:, 2:]
        keys.append(k)
        values.append(v)
    return query, keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [(7, 1, 40, 13), (64, 64, 64), (300,)], ids=["ragged", "equal", "one"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_each_lane_gets_the_bits_of_its_own_call(dtype, lengths, threads):
    query, keys, values = _lanes(lengths, dtype=dtype)
    ends = [t + 5 * i for i, t in enumerate(lengths)]  # lanes that have seen more than they hold (an eviction cache)
    for window, softcap in ((None, None), (6, 30.0)):
        out = dots.attention_lanes(query, keys, values, ends, 0.125, softcap, window, threads=threads)
        assert out.shape == (len(lengths), 1, 9, 64) and out.dtype == dtype
        for i in range(len(lengths)):
            alone = dots.attention(query[i], keys[i], values[i], ends[i], 0.125, softcap, window, threads=1)
            assert torch.equal(out[i], alone), (i, window)


def test_strided_keys_and_grouped_heads():
    query, keys, values = _lanes((5, 9, 2), heads=8, kv_heads=2, d=48, strided=True, seed=1)
    out = dots.attention_lanes(query, keys, values, [5, 9, 2], 0.2, threads=2)
    for i in range(3):
        assert torch.equal(out[i], dots.attention(query[i], keys[i], values[i], [5, 9, 2][i], 0.2, threads=1))


def test_a_lane_never_sees_another_lanes_keys():
    """The same query in every lane over different keys: the outputs differ lane by lane, as the lanes' own calls do."""
    query, keys, values = _lanes((16, 16, 16), seed=2)
    query = query[:1].expand(3, -1, -1, -1).contiguous()
    out = dots.attention_lanes(query, keys, values, [16, 16, 16], 0.125, threads=2)
    assert not torch.equal(out[0], out[1]) and not torch.equal(out[1], out[2])
    swapped = dots.attention_lanes(
        query, [keys[1], keys[0], keys[2]], [values[1], values[0], values[2]], [16] * 3, 0.125
    )
    assert torch.equal(swapped[0], out[1]) and torch.equal(swapped[1], out[0]) and torch.equal(swapped[2], out[2])


def test_shapes_it_cannot_take_are_refused_with_what_it_takes():
    query, keys, values = _lanes((4, 4))
    with pytest.raises(ValueError, match="query .* for 2 keys, 1 values"):
        dots.attention_lanes(query, keys, values[:1], [4, 4], 0.125)
    with pytest.raises(ValueError, match="lane 1's key"):
        dots.attention_lanes(query, [keys[0], keys[1][:, :, :32]], values, [4, 4], 0.125)
    with pytest.raises(ValueError, match="queries over keys"):
        dots.attention_lanes(query, keys, values, [4, 3], 0.125)  # a lane ending before its last key
