"""The calibration-free TurboQuant-style codec (random rotation + Gaussian Lloyd-Max codes) and its transformers cache,
on random data and a tiny random Llama."""

import math

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

from hf_kvcodecs.bench.memory import cache_bytes, shared_storages
from hf_kvcodecs.codecs.lloyd_max import gaussian_lloyd_max
from hf_kvcodecs.codecs.turboquant import (
    SUPPORTED_BITS,
    TurboQuantCodec,
    TurboQuantRotations,
    bytes_per_vector,
    coordinate_groups,
    held_bits_per_element,
    random_rotations,
    rotation_bytes,
)
from hf_kvcodecs.integrations.turboquant_cache import TurboQuantCache, TurboQuantLayer

from .conftest import tiny_llama_config

LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 16


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    # larger weights than the default 0.02, so that what the cache returns changes the logits visibly, yet not so
    # large that the random model turns chaotic and amplifies any error alike
    return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=LAYERS, initializer_range=0.05)).eval()


def gaussian_grid(points: int = 400_001, reach: float = 12.0):
    x = torch.linspace(-reach, reach, points, dtype=torch.float64)
    return x, torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


# ---- Lloyd-Max quantizers ------------------------------------------------------------------------------------------


def test_lloyd_max_levels_are_the_conditional_means_of_their_cells():
    for bits in (1, 2, 3, 4):
        quantizer = gaussian_lloyd_max(bits)
        levels = torch.tensor(quantizer.levels, dtype=torch.float64)
        thresholds = torch.tensor(quantizer.thresholds, dtype=torch.float64)
        assert len(levels) == 2**bits and bool((levels.diff() > 0).all())
        # nearest-neighbour condition: each boundary halfway between its two levels
        assert torch.allclose(thresholds, (levels[1:] + levels[:-1]) / 2, atol=1e-12)
        # centroid condition, checked by numerical integration over each cell rather than the closed form the
        # design used (the outer cells are cut at +-12, where the density is below 1e-31)
        bounds = [-12.0, *quantizer.thresholds, 12.0]
        for index, level in enumerate(quantizer.levels):
            x = torch.linspace(bounds[index], bounds[index + 1], 20_001, dtype=torch.float64)
            density = torch.exp(-0.5 * x * x)
            mean = torch.trapezoid(x * density, x) / torch.trapezoid(density, x)
            assert mean.item() == pytest.approx(level, abs=1e-7)


def test_lloyd_max_error_is_one_minus_two_over_pi_at_one_bit_and_falls_with_bits():
    x, density = gaussian_grid()
    # one bit: levels +-E|X| = +-sqrt(2/pi), so the error is E[X^2] - E|X|^2 = 1 - 2/pi
    assert gaussian_lloyd_max(1).levels[1] == pytest.approx(math.sqrt(2 / math.pi), abs=1e-12)
    assert gaussian_lloyd_max(1).mse == pytest.approx(1 - 2 / math.pi, abs=1e-12)
    errors = []
    for bits in (1, 2, 3, 4):
        quantizer = gaussian_lloyd_max(bits)
        reconstructed = torch.tensor(quantizer.levels, dtype=torch.float64)[
            torch.bucketize(x, torch.tensor(quantizer.thresholds, dtype=torch.float64))]
        integrated = torch.trapezoid((x - reconstructed) ** 2 * density, x).item()
        assert quantizer.mse == pytest.approx(integrated, rel=1e-6)
        errors.append(quantizer.mse)
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.01
    assert gaussian_lloyd_max(3) is gaussian_lloyd_max(3)  # designed once, then kept
    with pytest.raises(ValueError, match="designed for"):
        gaussian_lloyd_max(5)


# ---- rotations and the codec ---------------------------------------------------------------------------------------


def test_rotations_are_orthogonal_and_deterministic_per_seed():
    rotations = random_rotations(seed=3, layer=1, heads=KV_HEADS, dim=HEAD_DIM)
    assert rotations.shape == (KV_HEADS, HEAD_DIM, HEAD_DIM) and rotations.dtype == torch.float32
    identity = torch.eye(HEAD_DIM).expand(KV_HEADS, -1, -1)
    assert torch.allclose(rotations @ rotations.transpose(-1, -2), identity, atol=1e-6)
    assert torch.equal(rotations, random_rotations(3, 1, KV_HEADS, HEAD_DIM))
    assert not torch.allclose(rotations, random_rotations(4, 1, KV_HEADS, HEAD_DIM))  # another seed
    assert not torch.allclose(rotations, random_rotations(3, 2, KV_HEADS, HEAD_DIM))  # another layer
    assert not torch.allclose(rotations[0], rotations[1])  # each KV head its own
    bank = TurboQuantRotations(KV_HEADS, HEAD_DIM, seed=3)
    assert bank.layer(1) is bank.layer(1) and torch.equal(bank.layer(1), rotations)
    assert bank.nbytes() == rotation_bytes(1, KV_HEADS, HEAD_DIM) == KV_HEADS * HEAD_DIM**2 * 4


def correlated_heads(tokens: int = 512, generator_seed: int = 0):
    """Head vectors with an uneven spectrum and an offset, as keys have: the rotation must make them codable."""
    generator = torch.Generator().manual_seed(generator_seed)
    spectrum = torch.logspace(0, -1.5, HEAD_DIM)
    return (torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=generator) * spectrum
            + torch.randn(HEAD_DIM, generator=generator)) * 7.0


def test_coding_error_falls_with_bits_and_matches_the_lloyd_max_error():
    states, rotations = correlated_heads(), random_rotations(0, 0, KV_HEADS, HEAD_DIM)
    errors = {}
    for bits in SUPPORTED_BITS:
        codec = TurboQuantCodec(bits, HEAD_DIM)
        coded = codec.encode(states, rotations)
        decoded = codec.decode(coded, rotations)
        assert decoded.shape == states.shape
        errors[bits] = ((decoded - states).pow(2).sum(-1) / states.pow(2).sum(-1)).mean().item()
    assert list(errors.values()) == sorted(errors.values(), reverse=True)
    for bits in (1, 2, 3, 4):  # relative error ~ the Gaussian quantizer's, whatever the vectors' spectrum
        assert errors[bits] == pytest.approx(gaussian_lloyd_max(bits).mse, rel=0.25)


def test_codes_are_bit_packed_and_bytes_held_are_exact():
    states, rotations = correlated_heads(tokens=10), random_rotations(0, 0, KV_HEADS, HEAD_DIM)
    for bits in SUPPORTED_BITS:
        coded = TurboQuantCodec(bits, HEAD_DIM).encode(states, rotations)
        assert coded.codes.dtype == torch.uint8 and coded.norms.dtype == torch.float16
        assert coded.norms.shape == (1, KV_HEADS, 10)
        # exactly bits * d code bits + a 16-bit norm per vector, nothing else
        assert coded.codes.shape == (1, KV_HEADS, 10, int(bits * HEAD_DIM) // 8)
        assert cache_bytes(coded) == KV_HEADS * 10 * bytes_per_vector(bits, HEAD_DIM)
        assert held_bits_per_element(bits, HEAD_DIM) == bits + 16 / HEAD_DIM
    # a half whose length is no multiple of 8 is padded to whole bytes, and the padding counts as held
    assert bytes_per_vector(3, 20) == 9 + 2 and bytes_per_vector(2.5, 20) == (2 * 2 + 2 * 3) + 2


def test_fractional_rates_code_half_the_coordinates_at_one_bit_more():
    assert coordinate_groups(2.5, HEAD_DIM) == ((0, 8, 2), (8, 16, 3))
    assert coordinate_groups(3.5, 64) == ((0, 32, 3), (32, 64, 4))
    assert coordinate_groups(3, 64) == ((0, 64, 3),)
    states, rotations = correlated_heads(), random_rotations(0, 0, KV_HEADS, HEAD_DIM)
    codec = TurboQuantCodec(2.5, HEAD_DIM)
    coded = codec.encode(states, rotations)
    decoded = codec.decode(coded, rotations)
    # in the rotated frame, each half is reconstructed on its own width's levels
    rotated = (decoded / coded.norms.float().unsqueeze(-1)) @ rotations * math.sqrt(HEAD_DIM)
    for start, stop, width in codec.groups:
        levels = torch.tensor(gaussian_lloyd_max(width).levels)
        distance = (rotated[..., start:stop].unsqueeze(-1) - levels).abs().amin(-1)
        assert distance.max() < 1e-5


def test_bad_codec_options_are_refused():
    for bits in (5, 0, 2.25, True, "2"):
        with pytest.raises(ValueError, match="choose one of"):
            TurboQuantCodec(bits, HEAD_DIM)
    with pytest.raises(ValueError, match="16-dim head vectors"):
        TurboQuantCodec(2, HEAD_DIM).encode(torch.zeros(1, KV_HEADS, 3, 8), random_rotations(0, 0, KV_HEADS, 8))


# ---- the cache on a tiny Llama -------------------------------------------------------------------------------------


def test_generation_matches_the_full_precision_cache_while_every_token_is_in_the_window(model):
    prompt = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    settings = dict(do_sample=False, max_new_tokens=12, attention_mask=torch.ones_like(prompt))
    reference = model.generate(prompt, cache=DynamicCache(config=model.config), **settings)
    cache = TurboQuantCache(model.config, bits=2, residual_length=32)
    assert torch.equal(model.generate(prompt, cache=cache, **settings), reference)
    assert all(layer.coded_keys is None for layer in cache.layers)  # 31 tokens held: none left the window


def test_beam_search_reorders_the_codes_with_the_window(model):
    prompt = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(4))
    settings = dict(do_sample=False, max_new_tokens=8, attention_mask=torch.ones_like(prompt), num_beams=3)
    reference = model.generate(prompt, cache=DynamicCache(config=model.config), **settings)
    assert torch.equal(model.generate(prompt, cache=TurboQuantCache(model.config, residual_length=40), **settings),
                       reference)
    cache = TurboQuantCache(model.config, bits=3, residual_length=4)
    with torch.no_grad():
        model(prompt, cache=cache)
    layer, rotation = cache.layers[1], cache.rotations.layer(1)
    before = torch.cat([layer.codec.decode(layer.coded_values, rotation), layer.values], dim=-2)
    cache.reorder_cache(torch.tensor([1, 0]))
    after = torch.cat([layer.codec.decode(layer.coded_values, rotation), layer.values], dim=-2)
    assert torch.equal(after, before.flip(0))


def prefill_then_score(model, cache, ids, prefill_tokens):
    with torch.no_grad():
        model(ids[:, :prefill_tokens], cache=cache)
        return model(ids[:, prefill_tokens:], cache=cache).logits


def test_beyond_the_window_4_bits_stay_close_and_2_bits_drift_further(model):
    ids = torch.randint(3, 128, (1, 96), generator=torch.Generator().manual_seed(1))
    reference = prefill_then_score(model, DynamicCache(config=model.config), ids, 80)
    drift, kl = {}, {}
    for bits in (2, 4):
        cache = TurboQuantCache(model.config, bits=bits, residual_length=8)
        logits = prefill_then_score(model, cache, ids, 80)
        drift[bits] = (logits - reference).abs().max().item()
        kl[bits] = torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                              reduction="none").sum(-1).mean().item()
        assert cache.get_seq_length() == 96
        assert cache.layers[0].coded_keys.norms.shape[-1] == 96 - 8 and cache.layers[0].keys.shape[-2] == 8
    assert 0 < drift[4] < 0.5 * drift[2] and kl[4] < 0.1 * kl[2]
    assert drift[4] < 0.05 * reference.abs().max().item() and kl[4] < 1e-3


def test_protected_layers_are_exact_and_the_others_coded(model):
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    reference, cache = DynamicCache(config=model.config), TurboQuantCache(model.config, bits=2, residual_length=4,
                                                                           protected_layers=1)
    with torch.no_grad():
        model(ids, cache=reference)
        model(ids, cache=cache)
    assert [type(layer) for layer in cache.layers] == [DynamicLayer, TurboQuantLayer, TurboQuantLayer, DynamicLayer]
    for index in (0, LAYERS - 1):
        assert torch.equal(cache.layers[index].keys, reference.layers[index].keys)
        assert torch.equal(cache.layers[index].values, reference.layers[index].values)
    coded = cache.layers[1]
    rotation = cache.rotations.layer(1)
    decoded = torch.cat([coded.codec.decode(coded.coded_keys, rotation), coded.keys], dim=-2)
    assert decoded.shape == reference.layers[1].keys.shape and not torch.equal(decoded, reference.layers[1].keys)
    assert torch.equal(coded.keys, reference.layers[1].keys[..., -4:, :])  # the window is exact


def test_cache_bytes_are_codes_norms_and_window_with_rotations_reported_apart(model):
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(3))
    window, bits = 10, 2.5
    shared = TurboQuantRotations(KV_HEADS, HEAD_DIM)
    caches = [TurboQuantCache(model.config, bits=bits, residual_length=window, rotations=shared) for _ in range(2)]
    own = TurboQuantCache(model.config, bits=bits, residual_length=window)
    with torch.no_grad():
        for cache in (*caches, own):
            model(ids, cache=cache)
    codes = LAYERS * 2 * KV_HEADS * (50 - window) * bytes_per_vector(bits, HEAD_DIM)
    exact_window = LAYERS * 2 * KV_HEADS * window * HEAD_DIM * 4  # fp32 model
    rotations = rotation_bytes(LAYERS, KV_HEADS, HEAD_DIM)
    common = shared_storages(*caches)
    assert sum(common.values()) == rotations == shared.nbytes()
    assert cache_bytes(caches[0], excluding=common) == codes + exact_window
    assert cache_bytes(own) == codes + exact_window + rotations  # a cache that builds its own holds them


def test_bad_cache_options_raise_a_clear_error(model):
    with pytest.raises(ValueError, match=r"bits=5: .*choose one of \['1', '1.5', '2', '2.5', '3', '3.5', '4'\]"):
        TurboQuantCache(model.config, bits=5)
    with pytest.raises(ValueError, match="residual_length=-1: pass a non-negative integer number of tokens"):
        TurboQuantCache(model.config, residual_length=-1)
    with pytest.raises(ValueError, match="protected_layers=1.5: pass a non-negative integer number of layers"):
        TurboQuantCache(model.config, protected_layers=1.5)
    with pytest.raises(ValueError, match="seed=1 differs from the given rotations' seed 0"):
        TurboQuantCache(model.config, seed=1, rotations=TurboQuantRotations(KV_HEADS, HEAD_DIM))
    with pytest.raises(ValueError, match="rotations are for 2 heads of 32 dims"):
        TurboQuantCache(model.config, rotations=TurboQuantRotations(KV_HEADS, 32))
    with pytest.raises(ValueError, match="full attention"):
        TurboQuantCache(tiny_llama_config(layer_types=["full_attention", "sliding_attention"], sliding_window=8))
    with pytest.warns(UserWarning, match="keeps all 4 layers at full precision"):
        TurboQuantCache(model.config, protected_layers=2)
