"""Whitened codes with water-filled bits per component (hf_kvcodecs.codecs.bit_allocation)."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_kvcodecs.codecs import bit_allocation as ba


def _spectrum(rank: int = 48, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    decay = torch.logspace(1, -3, rank, dtype=torch.float64)
    return (decay * (1 + 0.3 * torch.rand(rank, generator=generator, dtype=torch.float64))).sort(descending=True).values


def _gaussian_codes(variances: torch.Tensor, tokens: int = 2000, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, variances.numel(), generator=generator) * variances.float().sqrt()


def _model_distortion(variances, bits, quantizer="lloyd-max") -> float:
    table = torch.tensor([ba.gaussian_distortion(b, quantizer) for b in range(ba.MAX_BITS + 1)], dtype=torch.float64)
    return float((variances.double() * table[bits]).sum())


def _relative_error(codes, variances, bits, **options) -> float:
    packed, gain = ba.encode(codes, variances, bits, **options)
    rebuilt = ba.decode(packed, variances, bits, gain, quantizer=options.get("quantizer", "lloyd-max"))
    return float((codes - rebuilt).square().sum() / codes.square().sum())


# ----------------------------------------------------------------------------------------------------- quantizers


def test_gaussian_quantizer_tables_match_the_published_ones():
    assert ba.gaussian_distortion(0) == 1.0
    assert ba.gaussian_distortion(1) == pytest.approx(1 - 2 / math.pi, rel=1e-6)
    assert ba.gaussian_distortion(2) == pytest.approx(0.1175, rel=1e-3)
    assert ba.gaussian_distortion(3) == pytest.approx(0.03454, rel=1e-3)
    # Max (1960), 16 levels: the positive reconstruction levels
    levels = ba.gaussian_quantizer(4)[1][8:]
    published = torch.tensor([0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733])
    assert torch.allclose(levels, published, atol=2e-3)
    # the optimal uniform step for a Gaussian at 4 bits is 0.3352
    uniform = ba.gaussian_quantizer(4, "uniform")[1]
    assert float(uniform[1] - uniform[0]) == pytest.approx(0.3352, rel=2e-3)
    for quantizer in ba.QUANTIZERS:
        table = [ba.gaussian_distortion(b, quantizer) for b in range(ba.MAX_BITS + 1)]
        steps = [a - b for a, b in itertools.pairwise(table)]
        assert all(step > 0 for step in steps) and all(a > b for a, b in itertools.pairwise(steps))  # convex


@pytest.mark.parametrize("quantizer", ba.QUANTIZERS)
def test_stated_distortion_is_the_measured_one(quantizer):
    samples = torch.randn(400_000, generator=torch.Generator().manual_seed(0))
    for bits in (1, 3, 5, 8):
        thresholds, levels = ba.gaussian_quantizer(bits, quantizer)
        measured = float((samples - levels[torch.bucketize(samples, thresholds)]).square().mean())
        assert measured == pytest.approx(ba.gaussian_distortion(bits, quantizer), rel=0.03)


@pytest.mark.parametrize("quantizer", ba.QUANTIZERS)
def test_lookup_indices_equal_bucketize(quantizer):
    generator = torch.Generator().manual_seed(2)
    for bits in range(1, ba.MAX_BITS + 1):
        thresholds, levels = ba.gaussian_quantizer(bits, quantizer)
        edges = torch.cat((thresholds, thresholds.nextafter(torch.tensor(math.inf)),
                           thresholds.nextafter(torch.tensor(-math.inf))))
        values = torch.cat((3 * torch.randn(20_000, generator=generator), edges, torch.tensor([1e30, -1e30, 0.0])))
        lookup = ba._Lookup(thresholds, levels, "cpu")
        assert torch.equal(lookup.indices(values), torch.bucketize(values, thresholds))


# ----------------------------------------------------------------------------------------------------- allocation


@pytest.mark.parametrize("budget", [0, 1, 7, 48, 100, 200, 384])
def test_allocation_spends_the_budget_and_never_increases(budget):
    variances = _spectrum()
    bits = ba.allocate_bits(variances, budget)
    assert bits.dtype == torch.int64 and bits.shape == variances.shape
    assert int(bits.sum()) == min(budget, variances.numel() * ba.MAX_BITS)
    assert bool((bits[1:] <= bits[:-1]).all())
    assert int(bits.min()) >= 0 and int(bits.max()) <= ba.MAX_BITS


def test_allocation_caps_the_budget_and_truncates_the_rank():
    variances = _spectrum(16)
    assert ba.allocate_bits(variances, 10_000).tolist() == [8] * 16
    assert ba.allocate_bits(variances, 10_000, max_bits=4).tolist() == [4] * 16
    small = ba.allocate_bits(variances, 12)
    assert int((small > 0).sum()) < 16  # the trailing components are not sent at all
    assert ba.allocate_bits(variances, 0).tolist() == [0] * 16


@pytest.mark.parametrize("budget", [5, 40, 97, 160])
def test_greedy_allocation_is_as_good_as_the_dynamic_program(budget):
    variances = _spectrum(24, seed=budget)
    greedy = ba.allocate_bits(variances, budget)
    exact = ba._dynamic_program(variances, budget, ba._distortion_table("lloyd-max"), list(range(ba.MAX_BITS + 1)))
    assert int(exact.sum()) == int(greedy.sum()) == budget
    assert _model_distortion(variances, greedy) == pytest.approx(_model_distortion(variances, exact), rel=1e-12)


def test_allocation_is_optimal_among_all_non_increasing_allocations():
    variances = torch.tensor([5.0, 3.0, 2.9, 0.4, 0.01], dtype=torch.float64)
    weights = torch.tensor([0.1, 1.0, 2.0, 1.0, 1.0], dtype=torch.float64)  # importances out of order: the DP path
    importance = variances * weights
    for budget in (3, 6, 9):
        bits = ba.allocate_bits(variances, budget, max_bits=3, weights=weights)
        assert bool((bits[1:] <= bits[:-1]).all()) and int(bits.sum()) == budget
        best = min(_model_distortion(importance, torch.tensor(candidate))
                   for candidate in itertools.product(range(4), repeat=5)
                   if sum(candidate) == budget and all(a >= b for a, b in itertools.pairwise(candidate)))
        assert _model_distortion(importance, bits) == pytest.approx(best, rel=1e-12)


def test_allowed_widths_subset():
    variances = _spectrum(32)
    bits = ba.allocate_bits(variances, 101, allowed=(2, 4, 8))  # 0 is always allowed
    assert set(bits.tolist()) <= {0, 2, 4, 8}
    assert int(bits.sum()) == 100  # odd budgets are out of reach of even widths: the largest reachable sum
    assert bool((bits[1:] <= bits[:-1]).all())
    assert ba.allocate_bits(variances, 50, allowed=(4,), max_bits=8).tolist() == [4] * 12 + [0] * 20


def test_water_filling_levels_the_distortion_of_the_components_sent():
    variances = _spectrum()
    rates = ba.water_filling_bits(variances, 100)
    assert float(rates.sum()) == pytest.approx(100, rel=1e-9)
    sent = rates > 0
    levels = variances[sent] * torch.exp2(-2 * rates[sent])
    assert torch.allclose(levels, levels[0].expand_as(levels), rtol=1e-6)
    assert bool((variances[~sent] <= levels[0] * (1 + 1e-6)).all())  # below the water level: not sent
    integer = ba.allocate_bits(variances, 100).double()
    assert float((integer - rates).abs().max()) < 2.0  # the integer allocation follows the ideal


# -------------------------------------------------------------------------------------------- packing and prefixes


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 8), max_size=40), st.integers(0, 4), st.data())
def test_pack_unpack_round_trip_for_any_widths(widths, tokens, data):
    bits = torch.tensor(widths, dtype=torch.int64)
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    values = torch.stack([torch.randint(0, 2**w, (tokens,), generator=generator) for w in widths], -1) \
        if widths else torch.zeros(tokens, 0, dtype=torch.int64)
    packed = ba.pack(values, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (tokens, ba.bytes_per_vector(bits))
    assert torch.equal(ba.unpack(packed, bits).long(), values)
    keep = data.draw(st.integers(0, len(widths)))
    assert torch.equal(ba.truncate(packed, bits, keep), ba.pack(values[:, :keep], bits[:keep]))


@pytest.mark.parametrize("gain", [False, True])
def test_truncated_bytes_decode_as_the_full_code_with_trailing_components_dropped(gain):
    variances = _spectrum()
    codes = _gaussian_codes(variances, 64)
    bits = ba.allocate_bits(variances, 150)
    packed, token_gain = ba.encode(codes, variances, bits, gain=gain)
    assert packed.shape[-1] == ba.bytes_per_vector(bits) == math.ceil(150 / 8)
    full = ba.decode(packed, variances, bits, token_gain)
    for keep in range(0, variances.numel() + 1, 5):
        cut = ba.truncate(packed, bits, keep)
        assert torch.equal(cut, packed[..., :cut.shape[-1]] if int(bits[:keep].sum()) % 8 == 0 else cut)
        assert cut.shape[-1] == math.ceil(int(bits[:keep].sum()) / 8)
        prefix = ba.decode(cut, variances[:keep], bits[:keep], token_gain)
        assert torch.equal(prefix, full[..., :keep])
        # zero-padding the prefix back to full rank is the full code with its trailing components zeroed
        padded = torch.nn.functional.pad(prefix, (0, variances.numel() - keep))
        expected = full.clone()
        expected[..., keep:] = 0
        assert torch.equal(padded, expected)


@pytest.mark.parametrize("quantizer", ba.QUANTIZERS)
def test_error_shrinks_with_bits(quantizer):
    variances = _spectrum()
    codes = _gaussian_codes(variances)
    errors = [_relative_error(codes, variances, ba.allocate_bits(variances, budget, quantizer=quantizer),
                              quantizer=quantizer) for budget in (24, 48, 96, 192, 384)]
    assert all(a > b for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < 1e-4  # 8 bits everywhere
    # on Gaussian codes the measured error is the one the allocation modelled
    bits = ba.allocate_bits(variances, 96, quantizer=quantizer)
    modelled = _model_distortion(variances, bits, quantizer) / float(variances.sum())
    assert _relative_error(codes, variances, bits, quantizer=quantizer) == pytest.approx(modelled, rel=0.1)


def test_gain_absorbs_per_token_energy():
    variances = _spectrum()
    loudness = torch.exp(torch.randn(2000, 1, generator=torch.Generator().manual_seed(3)))
    codes = _gaussian_codes(variances) * loudness
    budget = 160
    plain = _relative_error(codes, variances, ba.allocate_bits(variances, budget))
    with_gain = _relative_error(codes, variances, ba.allocate_bits(variances, budget - 8 * ba.GAIN_BYTES), gain=True)
    assert with_gain < 0.5 * plain
    assert ba.bytes_per_vector(ba.allocate_bits(variances, budget - 8), gain=True) == budget // 8


def test_imposed_gains_are_used_as_given():
    variances = _spectrum(8)
    codes = _gaussian_codes(variances, 10)
    bits = ba.allocate_bits(variances, 32)
    imposed = torch.full((10,), ba.GAIN_ZERO + ba.GAIN_STEPS_PER_OCTAVE, dtype=torch.uint8)  # gain 2
    packed, gain = ba.encode(codes, variances, bits, gain=imposed)
    assert torch.equal(gain, imposed)
    assert float(ba.gain_values(gain)[0]) == 2.0
    reference, _ = ba.encode(codes / 2, variances, bits)
    assert torch.equal(packed, reference)


def test_zero_variance_components_decode_to_zero():
    variances = torch.tensor([4.0, 1.0, 0.0, 0.0])
    codes = torch.tensor([[1.0, -0.5, 0.0, 0.0], [-3.0, 0.2, 0.0, 0.0]])
    bits = torch.tensor([4, 4, 2, 2])
    packed, _ = ba.encode(codes, variances, bits)
    rebuilt = ba.decode(packed, variances, bits)
    assert torch.isfinite(rebuilt).all() and bool((rebuilt[:, 2:] == 0).all())


def test_leading_dimensions_are_kept():
    variances = _spectrum(12)
    codes = _gaussian_codes(variances, 24).reshape(2, 3, 4, 12)
    bits = ba.allocate_bits(variances, 40)
    packed, gain = ba.encode(codes, variances, bits, gain=True)
    assert packed.shape == (2, 3, 4, 5) and gain.shape == (2, 3, 4)
    flat, flat_gain = ba.encode(codes.reshape(-1, 12), variances, bits, gain=True)
    assert torch.equal(packed.reshape(-1, 5), flat) and torch.equal(gain.reshape(-1), flat_gain)
    assert ba.decode(packed, variances, bits, gain).shape == codes.shape


# ---------------------------------------------------------------------------------------------------------- errors


def test_wrong_sizes_raise_errors_naming_the_fix():
    variances = _spectrum(12)
    codes = _gaussian_codes(variances, 4)
    bits = ba.allocate_bits(variances, 40)
    packed, gain = ba.encode(codes, variances, bits, gain=True)
    with pytest.raises(ValueError, match="bytes per vector.*bits_per_component they were packed with"):
        ba.decode(packed[..., :-1], variances, bits, gain)
    with pytest.raises(ValueError, match="first keep_components widths"):
        ba.unpack(ba.truncate(packed, bits, 6), bits)
    with pytest.raises(ValueError, match="variances of exactly the components coded"):
        ba.decode(packed, variances[:6], bits, gain)
    with pytest.raises(ValueError, match="one width per component"):
        ba.encode(codes[..., :6], variances, bits)
    with pytest.raises(ValueError, match="pass the gain encode returned"):
        ba.decode(packed, variances, bits, gain[:2])
    with pytest.raises(ValueError, match="uint8"):
        ba.decode(packed.long(), variances, bits)
    with pytest.raises(ValueError, match="outside \\[0, 3\\]"):
        ba.pack(torch.tensor([[4]]), torch.tensor([2]))
    with pytest.raises(ValueError, match="between 0 and 8"):
        ba.pack(torch.tensor([[1]]), torch.tensor([9]))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        ba.bytes_per_vector(torch.tensor([2.0, 3.0]))
    with pytest.raises(ValueError, match="keep_components must be between 0 and 12"):
        ba.truncate(packed, bits, 13)
    with pytest.raises(ValueError, match="widths of the full code"):
        ba.truncate(packed[..., :-1], bits, 3)
    with pytest.raises(ValueError, match="imposed gain must be uint8"):
        ba.encode(codes, variances, bits, gain=torch.ones(4))
    with pytest.raises(ValueError, match="non-finite"):
        ba.encode(codes.masked_fill(codes > 0, math.nan), variances, bits)
    with pytest.raises(ValueError, match="finite non-negative"):
        ba.allocate_bits(-variances, 10)
    with pytest.raises(ValueError, match="quantizer must be one of"):
        ba.allocate_bits(variances, 10, quantizer="nf4")
    with pytest.raises(ValueError, match="weights must be"):
        ba.allocate_bits(variances, 10, weights=torch.ones(3))
