"""``python -m layernorm``: what this build runs on, the classic LayerNorm examples and pitfalls."""

from __future__ import annotations

import os
import sys
import textwrap

import numpy as np
import numpy.typing as npt

import layernorm
from layernorm import LayerNorm, layer_norm
from layernorm.testing import diagnose

# The (2, 3, 4) embedding batch that torch.manual_seed(42) + randint(0, 5) gives, and the output
# nn.LayerNorm(4) printed for it in a public write-up (rounded to 4 decimals).
EMBEDDING = [[[2, 2, 1, 4], [1, 0, 0, 4], [0, 3, 3, 4]],
             [[0, 4, 1, 2], [0, 0, 2, 1], [4, 1, 3, 1]]]
TORCH_PUBLISHED = [[[-0.2294, -0.2294, -1.1471, 1.6059],
                    [-0.1525, -0.7625, -0.7625, 1.6775],
                    [-1.6667, 0.3333, 0.3333, 1.0000]],
                   [[-1.1832, 1.5213, -0.5071, 0.1690],
                    [-0.9045, -0.9045, 1.5075, 0.3015],
                    [1.3471, -0.9622, 0.5773, -0.9622]]]


# The (1, 3, 5, 5) image of another write-up: its channels are arange(1, 26), arange(11, 36) and
# arange(31, 56) as 5 x 5 planes.  nn.LayerNorm([3, 5, 5]) printed these first and last rows,
# and nn.LayerNorm(3) over the channels of every pixel printed the same triple 25 times.
IMAGE_CHANNEL_STARTS = (1, 11, 31)
IMAGE_PUBLISHED_FIRST_ROW = [-1.7584, -1.6890, -1.6196, -1.5502, -1.4808]
IMAGE_PUBLISHED_LAST_ROW = [1.7122, 1.7816, 1.8510, 1.9204, 1.9898]
IMAGE_PUBLISHED_PIXEL = [-1.0690, -0.2673, 1.3363]


class StdPlusEpsLayerNorm:
    """The hand-written module of two write-ups, in NumPy: it divides by std + eps."""

    def __init__(self, size: int, eps: float = 1e-5) -> None:
        self.weight = np.ones(size, np.float32)
        self.bias = np.zeros(size, np.float32)
        self.eps = eps

    def __call__(self, x: np.ndarray) -> np.ndarray:
        std = x.std(axis=-1, keepdims=True)
        y: np.ndarray = (x - x.mean(axis=-1, keepdims=True)) / (std + self.eps) * self.weight + self.bias
        return y


def fmt(values: npt.ArrayLike) -> str:
    """One row of numbers, 4 decimals, like torch prints them."""
    return "[" + ", ".join(f"{v:7.4f}" for v in np.ravel(values)) + "]"


def maxdiff(a: npt.ArrayLike, b: npt.ArrayLike) -> str:
    return f"{np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))):.1e}"


def main() -> int:
    rng = np.random.default_rng(0)
    print(f"layernorm {layernorm.__version__}: torch.nn.LayerNorm for NumPy (numpy {np.__version__})")
    levels = ", ".join(layernorm.available_simd_levels())
    print(f"  SIMD in use: {layernorm.simd_level()} (this CPU: {levels});"
          f" threads: {layernorm.get_num_threads()}")

    print("\n1. Embedding batch (2, 3, 4), LayerNorm(4)")
    embedding = np.array(EMBEDDING, dtype=np.float32)
    y = LayerNorm(4).eval()(embedding)
    for ours, published in zip(y.reshape(-1, 4), np.reshape(TORCH_PUBLISHED, (-1, 4))):
        print(f"   {fmt(ours)}   torch printed {fmt(published)}")
    print(f"   max |ours - torch's published output| = {maxdiff(y, TORCH_PUBLISHED)}"
          " (it is rounded to 1e-4)")

    print("\n2. arange(1, 19).reshape(3, 1, 6), LayerNorm(6)")
    ramp = np.arange(1, 19, dtype=np.float32).reshape(3, 1, 6)
    y6 = LayerNorm(6).eval()(ramp)
    print(f"   every row: {fmt(y6[0])}; rows equal: {bool((y6 == y6[0]).all())}")
    same = np.array_equal(LayerNorm(6).train()(ramp), y6)
    print(f"   train() and eval() give the same output: {same}")

    print("\n3. Image (1, 3, 5, 5): channels arange(1, 26), arange(11, 36), arange(31, 56) as 5 x 5")
    image = np.stack([np.arange(s, s + 25) for s in IMAGE_CHANNEL_STARTS])
    image = image.reshape(1, 3, 5, 5).astype(np.float32)
    whole = layer_norm(image, [3, 5, 5])
    print("   over [3, 5, 5] (one mean and variance per image):")
    print(f"     channel 0, row 0: {fmt(whole[0, 0, 0])}   torch printed {fmt(IMAGE_PUBLISHED_FIRST_ROW)}")
    print(f"     channel 2, row 4: {fmt(whole[0, 2, 4])}   torch printed {fmt(IMAGE_PUBLISHED_LAST_ROW)}")
    per_pixel = np.moveaxis(layer_norm(np.moveaxis(image, 1, -1), 3), -1, 1)
    pixels = per_pixel[0].reshape(3, 25).T
    print("   channel by channel: moveaxis(C last), LayerNorm(3), move back (torch needs two permutes)")
    print(f"     pixel (0, 0): {fmt(pixels[0])}   torch printed {fmt(IMAGE_PUBLISHED_PIXEL)}")
    print(f"     every pixel has channels 10 and 30 above the first: the 25 triples differ by at most"
          f" {maxdiff(pixels, np.broadcast_to(pixels[0], pixels.shape))}")

    print("\n4. Pitfalls of hand-written versions")
    x = rng.random((16, 768), dtype=np.float32)
    ours = layer_norm(x, 768)
    unbiased = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, ddof=1, keepdims=True) + 1e-5)
    ratio = np.median(unbiased / ours)
    print(f"   unbiased variance (ddof=1) on (16, 768): max diff {maxdiff(unbiased, ours)};"
          f" ratio {ratio:.6f} = sqrt(767/768) {np.sqrt(767 / 768):.6f}")
    u = rng.random((4, 20), dtype=np.float32)
    std_eps = (u - u.mean(-1, keepdims=True)) / (u.std(-1, keepdims=True) + 1e-5)
    print(f"   dividing by std + eps instead of sqrt(var + eps) on (4, 20) uniform:"
          f" max diff {maxdiff(std_eps, layer_norm(u, 20))} (about |xhat| * eps / std)")
    print("   layernorm.testing.diagnose on such a module, rows of other scales make it obvious:")
    print(textwrap.indent(str(diagnose(StdPlusEpsLayerNorm(20), 20)), "     "))

    try:
        import torch
    except ImportError:
        print("\n5. torch is not installed: no side-by-side comparison.")
        return 0
    except Exception as error:  # an install that fails to load (a library missing, say)
        print(f"\n5. torch is installed but could not be imported ({type(error).__name__}: {error}):"
              " no side-by-side comparison.")
        return 0
    print(f"\n5. Against torch {torch.__version__}")
    cases: list[tuple[np.ndarray, int | list[int], np.ndarray]] = [
        (embedding, 4, y), (ramp, 6, y6), (image, [3, 5, 5], whole), (x, 768, ours),
        (u, 20, layer_norm(u, 20))]
    worst = max(float(maxdiff(torch.nn.LayerNorm(shape)(torch.from_numpy(data)).detach().numpy(),
                              result))
                for data, shape, result in cases)
    permuted = torch.from_numpy(image).permute(0, 2, 3, 1)  # torch needs two permutes here
    theirs_cw = torch.nn.LayerNorm(3)(permuted).permute(0, 3, 1, 2).detach().numpy()
    print(f"   max |ours - torch.nn.LayerNorm| on the data above: {worst:.1e};"
          f" channel-wise: {maxdiff(per_pixel, theirs_cw)}")
    offset = (1e4 + rng.standard_normal((8, 4096))).astype(np.float32)
    exact = offset.astype(np.float64)
    centred = exact - exact.mean(-1, keepdims=True)
    reference = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-5)
    theirs = torch.nn.functional.layer_norm(torch.from_numpy(offset), (4096,)).numpy()
    print(f"   float32 rows 1e4 + randn(4096), max error against float64:"
          f" ours {maxdiff(layer_norm(offset, 4096), reference)}, torch {maxdiff(theirs, reference)}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except BrokenPipeError:
        # `python -m layernorm | head`: the reader left; no traceback for that (the Python
        # documentation's recipe: point stdout at devnull so the exit flush does not fail again)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1)
