"""Published torch.nn.LayerNorm outputs and the classic hand-written pitfalls.

Expected numbers typed in below are copied from torch outputs printed in the write-ups under
/work/shared/reference/ (each block cites its file); they are printed to 4 decimals, so they are
checked within 5e-5. Everything else is compared with a live torch (the oracle) or with
layernorm._reference.
"""

import importlib.metadata
import subprocess
import sys

import numpy as np
import pytest

import layernorm
from helpers import demo_output as run_demo
from helpers import reference_output, requires_torch, torch
from layernorm import LayerNorm

PRINTED_ATOL = 5e-5  # half a unit in the 4th decimal of the published printouts


def torch_layer_norm_module(x, normalized_shape, **kwargs):
    with torch.no_grad():
        return torch.nn.LayerNorm(normalized_shape, **kwargs)(torch.from_numpy(x)).numpy()


# ---------------------------------------------------------------------------------------------
# 001_348112338218bc5b.txt: the (2, 3, 4) embedding batch, nn.LayerNorm(4)
# ---------------------------------------------------------------------------------------------

# torch.randint(0, 5, (2, 3, 4)) with manual_seed(42), as printed in 001.
EMBEDDING_001 = np.array([[[2., 2., 1., 4.],
                           [1., 0., 0., 4.],
                           [0., 3., 3., 4.]],
                          [[0., 4., 1., 2.],
                           [0., 0., 2., 1.],
                           [4., 1., 3., 1.]]], dtype=np.float32)
# ln(embedding), as printed in 001 (torch output, 4 decimals).
PUBLISHED_001 = np.array([[[-0.2294, -0.2294, -1.1471, 1.6059],
                           [-0.1525, -0.7625, -0.7625, 1.6775],
                           [-1.6667, 0.3333, 0.3333, 1.0000]],
                          [[-1.1832, 1.5213, -0.5071, 0.1690],
                           [-0.9045, -0.9045, 1.5075, 0.3015],
                           [1.3471, -0.9622, 0.5773, -0.9622]]])


@pytest.mark.parametrize("api", ["module", "layer_norm", "native_layer_norm"])
def test_001_embedding_batch_matches_published(api):
    if api == "module":
        y = LayerNorm(4)(EMBEDDING_001)
    elif api == "layer_norm":
        y = layernorm.layer_norm(EMBEDDING_001, (4,))
    else:
        y = layernorm.native_layer_norm(EMBEDDING_001, (4,), None, None, 1e-5)[0]
    assert y.dtype == np.float32 and y.shape == (2, 3, 4)
    np.testing.assert_allclose(y, PUBLISHED_001, rtol=0, atol=PRINTED_ATOL)


@requires_torch
def test_001_embedding_batch_matches_live_torch():
    y = LayerNorm(4)(EMBEDDING_001)
    np.testing.assert_allclose(y, torch_layer_norm_module(EMBEDDING_001, 4), rtol=1e-6, atol=1e-6)


@requires_torch
def test_001_embedding_seed_reproduces_published_input():
    # Guards the transcription of the input above: torch regenerates it from the seed.
    torch.manual_seed(42)
    emb = torch.randint(0, 5, (2, 3, 4)).float().numpy()
    np.testing.assert_array_equal(emb, EMBEDDING_001)


# ---------------------------------------------------------------------------------------------
# 004_0296fcb4a6fea3a7.txt: nn.LayerNorm(6) on arange(1, 19).view(3, 1, 6)
# ---------------------------------------------------------------------------------------------

# Every row of the printed torch output in 004.
PUBLISHED_004_ROW = np.array([-1.4638, -0.8783, -0.2928, 0.2928, 0.8783, 1.4638])


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_004_arange_rows_match_published(mode):
    x = np.arange(1, 19, dtype=np.float32).reshape(3, 1, 6)
    m = LayerNorm(6)
    y = (m.train() if mode == "train" else m.eval())(x)
    assert y.shape == (3, 1, 6)
    np.testing.assert_allclose(y, np.broadcast_to(PUBLISHED_004_ROW, (3, 1, 6)), rtol=0,
                               atol=PRINTED_ATOL)


def test_004_layer_norm_matches_published():
    # layer_norm with an int normalized_shape on the same data: every output row is the published one.
    x = np.arange(1, 19, dtype=np.float32).reshape(3, 1, 6)
    out = layernorm.layer_norm(x, 6)
    np.testing.assert_allclose(out, np.broadcast_to(PUBLISHED_004_ROW, (3, 1, 6)), rtol=0, atol=PRINTED_ATOL)


def test_004_arange_matches_reference():
    x = np.arange(1, 19, dtype=np.float32).reshape(3, 1, 6)
    np.testing.assert_allclose(LayerNorm(6)(x), reference_output(x, (6,)), rtol=1e-6, atol=1e-6)


@requires_torch
def test_004_arange_matches_live_torch():
    x = np.arange(1, 19, dtype=np.float32).reshape(3, 1, 6)
    np.testing.assert_allclose(LayerNorm(6)(x), torch_layer_norm_module(x, 6), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# 002_47117c296af678e6.txt: the unbiased-variance pitfall on a (16, 768) uniform input
# ---------------------------------------------------------------------------------------------

def x_002():
    return np.random.default_rng(2002).random((16, 768), dtype=np.float32)


def hand_unbiased(x, how, eps=1e-5):
    """The write-up's hand computation: (x - mu) / sqrt(var + eps) with the N-1 variance."""
    if how == "np_var_ddof1":
        mu = x.mean(axis=-1, keepdims=True)
        var = x.var(axis=-1, ddof=1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps)
    t = torch.from_numpy(x)
    mu = t.mean(dim=-1, keepdim=True)
    var = t.var(dim=-1, keepdim=True)  # torch.var's default correction=1
    return ((t - mu) / (var + eps).sqrt()).numpy()


def test_002_ours_matches_reference():
    x = x_002()
    y = LayerNorm(768, elementwise_affine=False, bias=False)(x)
    np.testing.assert_allclose(y, reference_output(x, (768,)), rtol=1e-6, atol=1e-6)


@requires_torch
def test_002_ours_matches_nn_layer_norm():
    x = x_002()
    y = LayerNorm(768, elementwise_affine=False, bias=False)(x)
    expected = torch_layer_norm_module(x, 768, elementwise_affine=False, bias=False)
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=2e-6)


HAND_WAYS = ["np_var_ddof1", pytest.param("torch_var_default", marks=requires_torch)]


@pytest.mark.parametrize("how", HAND_WAYS)
def test_002_unbiased_hand_computation_differs_by_sqrt_n_minus_1_over_n(how):
    x = x_002()
    n = x.shape[-1]
    y = LayerNorm(768, elementwise_affine=False, bias=False)(x)
    hand = hand_unbiased(x, how)
    # The pitfall is real: the hand result is visibly off from LayerNorm ...
    assert np.max(np.abs(hand - y)) > 5e-4
    # ... and off by exactly the std factor sqrt((N-1)/N) (eps shifts it by ~eps/var/N ~ 1e-7).
    np.testing.assert_allclose(hand, y * np.sqrt((n - 1) / n), rtol=1e-5, atol=2e-6)


@requires_torch
@pytest.mark.parametrize("how", ["np_var_ddof1", "torch_var_default"])
def test_002_torch_nn_layer_norm_shows_the_same_factor(how):
    # The oracle agrees: nn.LayerNorm relates to the unbiased hand version by the same factor.
    x = x_002()
    n = x.shape[-1]
    expected = torch_layer_norm_module(x, 768, elementwise_affine=False, bias=False)
    np.testing.assert_allclose(hand_unbiased(x, how), expected * np.sqrt((n - 1) / n),
                               rtol=1e-5, atol=2e-6)


@requires_torch
def test_002_biased_variance_hand_computation_matches_ours():
    # The write-up's fix (correction=0) agrees with nn.LayerNorm, and so with ours.
    x = x_002()
    t = torch.from_numpy(x)
    mu = t.mean(dim=-1, keepdim=True)
    var = t.var(dim=-1, correction=0, keepdim=True)
    hand = ((t - mu) / (var + 1e-5).sqrt()).numpy()
    y = LayerNorm(768, elementwise_affine=False, bias=False)(x)
    np.testing.assert_allclose(y, hand, rtol=1e-5, atol=5e-6)


# ---------------------------------------------------------------------------------------------
# 000_0bbd7b3761b78649.txt: dividing by std + eps instead of sqrt(var + eps), (4, 20) uniform
# ---------------------------------------------------------------------------------------------

def x_000():
    return np.random.default_rng(2000).random((4, 20), dtype=np.float32)


def std_plus_eps(x, eps=1e-5):
    """The write-up's MyLayerNorm: (x - mean) / (std(unbiased=False) + eps), in float32 torch."""
    t = torch.from_numpy(x)
    mean = t.mean(dim=(-1,), keepdim=True)
    std = t.std(dim=(-1,), keepdim=True, unbiased=False)
    return ((t - mean) / (std + eps)).numpy()


@requires_torch
def test_000_std_plus_eps_differs_from_nn_layer_norm_by_1e5_to_1e4():
    x = x_000()
    diff = np.max(np.abs(std_plus_eps(x) - torch_layer_norm_module(x, 20)))
    # 000 printed a max difference of 7.2598e-05 on its own random (4, 20) input.
    assert 1e-5 < diff < 1e-4


def test_000_ours_matches_reference_to_1e6():
    x = x_000()
    np.testing.assert_allclose(LayerNorm(20)(x), reference_output(x, (20,)), rtol=0, atol=1e-6)


@requires_torch
def test_000_ours_matches_torch_to_1e6():
    x = x_000()
    np.testing.assert_allclose(LayerNorm(20)(x), torch_layer_norm_module(x, 20), rtol=0, atol=1e-6)


@requires_torch
def test_000_ours_differs_from_std_plus_eps_like_torch_does():
    x = x_000()
    y = LayerNorm(20)(x)
    diff = np.max(np.abs(std_plus_eps(x) - y))
    assert 1e-5 < diff < 1e-4


# ---------------------------------------------------------------------------------------------
# 003_9d5b0e1909bc9587.txt: a (1, 3, 5, 5) image; normalized_shape [3, 5, 5] and per-pixel
# ---------------------------------------------------------------------------------------------

def image_003():
    # 003 stacks arange(1,26), arange(11,36), arange(31,56) (each 5x5) as the channels of an HWC
    # float32 image and ToTensor() turns it into CHW (float input: no scaling), then unsqueeze(0).
    hwc = np.dstack((np.arange(1, 26).reshape(5, 5), np.arange(11, 36).reshape(5, 5),
                     np.arange(31, 56).reshape(5, 5))).astype(np.float32)
    return np.ascontiguousarray(hwc.transpose(2, 0, 1))[None]


# The first and last channel blocks of norm(arr) as printed in 003 (the middle one is elided).
PUBLISHED_003_FIRST = np.array([[-1.7584, -1.6890, -1.6196, -1.5502, -1.4808],
                                [-1.4114, -1.3420, -1.2725, -1.2031, -1.1337],
                                [-1.0643, -0.9949, -0.9255, -0.8561, -0.7867],
                                [-0.7173, -0.6478, -0.5784, -0.5090, -0.4396],
                                [-0.3702, -0.3008, -0.2314, -0.1620, -0.0925]])
PUBLISHED_003_LAST = np.array([[0.3239, 0.3933, 0.4627, 0.5322, 0.6016],
                               [0.6710, 0.7404, 0.8098, 0.8792, 0.9486],
                               [1.0180, 1.0875, 1.1569, 1.2263, 1.2957],
                               [1.3651, 1.4345, 1.5039, 1.5733, 1.6427],
                               [1.7122, 1.7816, 1.8510, 1.9204, 1.9898]])
# The channel-wise variant (nn.LayerNorm(3) after permute) printed the same triple at every pixel.
PUBLISHED_003_PIXEL = np.array([-1.0690, -0.2673, 1.3363])


@pytest.mark.parametrize("block", ["first_channel", "last_channel"])
def test_003_image_3x5x5_matches_published(block):
    y = LayerNorm([3, 5, 5])(image_003())
    assert y.shape == (1, 3, 5, 5)
    got, published = (y[0, 0], PUBLISHED_003_FIRST) if block == "first_channel" else \
        (y[0, 2], PUBLISHED_003_LAST)
    np.testing.assert_allclose(got, published, rtol=0, atol=PRINTED_ATOL)


@requires_torch
def test_003_image_3x5x5_matches_live_torch():
    x = image_003()
    y = LayerNorm([3, 5, 5])(x)
    np.testing.assert_allclose(y, torch_layer_norm_module(x, [3, 5, 5]), rtol=1e-6, atol=1e-6)


def channelwise_ours(x):
    # normalize over C at every pixel: move C last (a non-contiguous view), normalize, move back.
    return np.moveaxis(LayerNorm(3)(np.moveaxis(x, 1, -1)), -1, 1)


def channelwise_torch(x):
    t = torch.from_numpy(x).permute(0, 2, 3, 1).contiguous()
    with torch.no_grad():
        return torch.nn.LayerNorm(3)(t).permute(0, 3, 1, 2).numpy()


@requires_torch
def test_003_channelwise_via_moveaxis_matches_torch_permute():
    x = image_003()
    y = channelwise_ours(x)
    assert y.shape == (1, 3, 5, 5)
    np.testing.assert_allclose(y, channelwise_torch(x), rtol=1e-6, atol=1e-6)


def test_003_channelwise_matches_published_pixel_triple():
    y = channelwise_ours(image_003())
    per_pixel = y[0].reshape(3, 25).T  # (25 pixels, 3 channels)
    np.testing.assert_allclose(per_pixel, np.broadcast_to(PUBLISHED_003_PIXEL, (25, 3)), rtol=0,
                               atol=PRINTED_ATOL)


@requires_torch
def test_003_channelwise_random_batch_matches_torch_permute():
    x = np.random.default_rng(2003).standard_normal((2, 3, 4, 5)).astype(np.float32)
    np.testing.assert_allclose(channelwise_ours(x), channelwise_torch(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# python -m layernorm
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_output():
    return run_demo()


def test_python_m_layernorm_runs_and_reports_version_and_simd(demo_output):
    level = subprocess.run([sys.executable, "-c", "import layernorm; print(layernorm.simd_level())"],
                           capture_output=True, text=True, timeout=60)
    assert level.returncode == 0, level.stderr
    level = level.stdout.strip()
    assert level in layernorm.available_simd_levels()
    # the version of the installed distribution (pyproject.toml), not a number typed in here
    assert layernorm.__version__ == importlib.metadata.version("layernorm")
    assert layernorm.__version__ in demo_output
    assert level in demo_output
    assert f"threads: {layernorm.get_num_threads()}" in demo_output


def numbers_after(text, label):
    """The bracketed row of numbers printed right after `label` (ours, before "torch printed")."""
    line = next(line for line in text.splitlines() if label in line)
    return first_row(line.split(label, 1)[1])


def first_row(text):
    return np.array([float(v) for v in text.split("[", 1)[1].split("]")[0].split(",")])


# (label in the demo's output, the published torch numbers it must show)
DEMO_PUBLISHED = [
    ("every row:", PUBLISHED_004_ROW),
    ("channel 0, row 0:", PUBLISHED_003_FIRST[0]),
    ("channel 2, row 4:", PUBLISHED_003_LAST[4]),
    ("pixel (0, 0):", PUBLISHED_003_PIXEL),
]


@pytest.mark.parametrize("label, published", DEMO_PUBLISHED, ids=[c[0] for c in DEMO_PUBLISHED])
def test_python_m_layernorm_shows_the_classic_examples(demo_output, label, published):
    # What the demo computed (printed to 4 decimals) is torch's published output.
    np.testing.assert_allclose(numbers_after(demo_output, label), published, rtol=0, atol=1.5e-4)


def test_python_m_layernorm_shows_the_embedding_batch(demo_output):
    lines = [line for line in demo_output.splitlines() if "torch printed" in line][:6]
    ours = np.array([first_row(line) for line in lines])
    np.testing.assert_allclose(ours, PUBLISHED_001.reshape(6, 4), rtol=0, atol=1.5e-4)


def test_python_m_layernorm_shows_the_pitfalls(demo_output):
    assert "unbiased variance" in demo_output and "sqrt(767/768)" in demo_output
    assert "std + eps" in demo_output


@requires_torch
def test_python_m_layernorm_compares_with_torch(demo_output):
    line = next(line for line in demo_output.splitlines() if "max |ours - torch.nn.LayerNorm|" in line)
    assert float(line.split(": ")[1].split(";")[0]) < 1e-5
    line = next(line for line in demo_output.splitlines() if "1e4 + randn(4096)" in line)
    ours, theirs = (float(line.split(who + " ")[1].split(",")[0]) for who in ("ours", "torch"))
    assert ours <= 1e-6 < 1e-4 < theirs
