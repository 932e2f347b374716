"""benchmarks/gsrq_prefill_encoder.py: the refine pass never worsens a code, fixes a deliberately bad one, and is
swapped in (and out) where the codecs call their encoder."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from hf_kvcodecs.codecs import joint, residual
from hf_kvcodecs.kernels import residual_encode
from hf_kvcodecs.kernels.reference import _transform_domain

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gsrq_prefill_encoder", ROOT / "benchmarks" / "gsrq_prefill_encoder.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _errors(z, codes, codebooks, stage_groups):
    return (z - _transform_domain(codes, codebooks, stage_groups, z.shape[1])).pow(2).sum(-1)


@pytest.mark.parametrize("beam_width", [1, 4])
def test_refine_never_raises_any_vectors_error(bench, beam_width):
    generator = torch.Generator().manual_seed(0)
    z = torch.randn(300, 16, generator=generator)
    codebooks = 0.5 * torch.randn(5, 64, 8, generator=generator)
    stage_groups = torch.tensor([0, 1, 0, 1, 0])
    codes = residual_encode(z, codebooks, stage_groups, beam_width)
    refined = bench.refine_codes(z, codes, codebooks, stage_groups)
    assert refined.dtype == torch.uint8 and refined.shape == codes.shape
    before, after = _errors(z, codes, codebooks, stage_groups), _errors(z, refined, codebooks, stage_groups)
    assert bool((after <= before + 1e-5).all())
    if beam_width == 1:  # greedy leaves codes a second look improves
        assert after.mean() < before.mean()


def test_refine_replaces_a_wrong_codeword_by_the_exact_one(bench):
    codebooks = torch.eye(4)[None].repeat(2, 1, 1)  # two stages on one 4-dim group, codewords the unit vectors
    z = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    wrong = torch.tensor([[0, 1]], dtype=torch.uint8)  # e0 + e1: stage 1 should have been e2
    refined = bench.refine_codes(z, wrong, codebooks, torch.tensor([0, 0]))
    assert refined.tolist() == [[0, 2]]


def test_refined_encoder_is_swapped_in_and_restored(bench):
    original = residual.residual_encode
    with bench.refined_encoder(True):
        assert residual.residual_encode is not original and joint.residual_encode is residual.residual_encode
    assert residual.residual_encode is original and joint.residual_encode is original
    with bench.refined_encoder(False):
        assert residual.residual_encode is original
