"""Pre-LN transformer blocks in NumPy with layernorm, their weights taken from torch models.

Two stacks, each run by torch and by NumPy on the same input:

- GPT-2 style: torch's nn.TransformerEncoderLayer(norm_first=True) blocks (causal self-attention,
  a GELU MLP), then a final LayerNorm.  In NumPy each residual add and the LayerNorm after it
  are one call, ``layernorm.add_layer_norm``: it returns both the new residual stream and its
  normalized copy, reading the stream once::

      h = h + attention(ln_1(h))         ->  y, h = add_layer_norm(attention(y), h, ...ln_2)
      h = h + mlp(ln_2(h))               ->  y, h = add_layer_norm(mlp(y), h, ...next ln_1)

- Llama style: RMSNorm -> attention -> residual -> RMSNorm -> SwiGLU MLP -> residual, with
  torch's nn.RMSNorm, and ``layernorm.add_rms_norm`` in NumPy (no rotary embedding: position
  plays no part in what is compared here).

``build_gpt2`` and ``build_llama`` return the NumPy and the torch forward of the same stack, for
the checks below and for timing.  Run ``python examples/transformer_blocks.py``: it prints one line
when NumPy's outputs match torch's to float32 precision, and fails otherwise.
"""

import math
from typing import Callable, Dict, List, NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import layernorm

# The largest difference from torch allowed, relative to the largest output: float32 rounding
# of two different summation orders through a few blocks (up to 3e-7 seen), tight enough to
# catch the classic porting mistake of Llama's RMSNorm eps as 1e-5 instead of 1e-6 (4.5e-6).
TOLERANCE = 1e-6


class Built(NamedTuple):
    """A model twice: NumPy (on float32 arrays) and torch (eval mode, no autograd), and an input."""

    numpy: Callable[[np.ndarray], np.ndarray]
    torch: Callable[[torch.Tensor], torch.Tensor]
    input: np.ndarray


def arrays(module: nn.Module) -> Dict[str, np.ndarray]:
    """A torch module's state_dict as NumPy arrays."""
    return {name: value.detach().numpy().copy() for name, value in module.state_dict().items()}


def perturb_norms(model: nn.Module, generator: torch.Generator) -> None:
    """Give the norms' weights and biases values of their own (torch starts them at 1 and 0)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                for param in module.parameters():
                    param.add_(0.1 * torch.randn(param.shape, generator=generator))


def causal_attention(x: np.ndarray, wq, wk, wv, n_heads: int) -> np.ndarray:
    """Multi-head causal self-attention of x (batch, seq, d) given its projections (callables),
    before the output projection."""
    batch, seq, d = x.shape
    head = d // n_heads

    def split(t):
        return t.reshape(batch, seq, n_heads, head).transpose(0, 2, 1, 3)

    q, k, v = split(wq(x)), split(wk(x)), split(wv(x))
    scores = q @ k.transpose(0, 1, 3, 2) / np.float32(math.sqrt(head))
    scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, np.float32(-np.inf))
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = scores / scores.sum(axis=-1, keepdims=True)
    return (weights @ v).transpose(0, 2, 1, 3).reshape(batch, seq, d)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GPT-2's GELU, the tanh approximation (torch's GELU(approximate="tanh")).  The cube is
    x * x * x, as torch's kernel forms it: NumPy's float32 x**3 goes through its power function,
    which took 5.9 ms on 64x1536 elements where x * x * x took 21 us (NumPy 2.4, AVX-512)."""
    inner = np.float32(math.sqrt(2 / math.pi)) * (x + np.float32(0.044715) * (x * x * x))
    return np.float32(0.5) * x * (1 + np.tanh(inner))


def gelu_tanh_torch(x: torch.Tensor) -> torch.Tensor:
    """The same in torch.  A function, not nn.GELU(approximate="tanh"): given that module, torch's
    TransformerEncoderLayer takes its fast path in eval mode, which computes the exact GELU."""
    return F.gelu(x, approximate="tanh")


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


# ---------------------------------------------------------------------------------------------
# GPT-2 style: nn.TransformerEncoderLayer(norm_first=True) blocks and a final LayerNorm
# ---------------------------------------------------------------------------------------------

def build_gpt2(d_model: int = 64, n_heads: int = 4, n_layers: int = 2, batch: int = 2, seq: int = 16,
               seed: int = 0) -> Built:
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    blocks = nn.ModuleList(
        nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, activation=gelu_tanh_torch,
                                   norm_first=True, batch_first=True)
        for _ in range(n_layers))
    final_norm = nn.LayerNorm(d_model)
    model = nn.ModuleDict({"blocks": blocks, "ln_f": final_norm}).eval()
    perturb_norms(model, generator)
    mask = nn.Transformer.generate_square_subsequent_mask(seq)

    @torch.no_grad()
    def torch_forward(x: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return final_norm(x)

    # NumPy: the same weights; the norms as layernorm modules and fused residual adds
    weights = [arrays(block) for block in blocks]
    first_norm = layernorm.LayerNorm(d_model).eval()
    first_norm.load_state_dict({"weight": weights[0]["norm1.weight"], "bias": weights[0]["norm1.bias"]})
    # the norm after each residual add: norm2 of the block, then norm1 of the next (ln_f last)
    norms_after_adds: List[Dict[str, np.ndarray]] = []
    for i, w in enumerate(weights):
        norms_after_adds.append({"weight": w["norm2.weight"], "bias": w["norm2.bias"]})
        after = arrays(final_norm) if i + 1 == len(weights) else {
            "weight": weights[i + 1]["norm1.weight"], "bias": weights[i + 1]["norm1.bias"]}
        norms_after_adds.append(after)

    def linear(w, name):
        return lambda t: t @ w[name + ".weight"].T + w[name + ".bias"]

    def attention(w, y):
        d = d_model
        proj_w, proj_b = w["self_attn.in_proj_weight"], w["self_attn.in_proj_bias"]
        q, k, v = ((lambda t, i=i: t @ proj_w[i * d:(i + 1) * d].T + proj_b[i * d:(i + 1) * d]) for i in range(3))
        return linear(w, "self_attn.out_proj")(causal_attention(y, q, k, v, n_heads))

    def numpy_forward(x: np.ndarray) -> np.ndarray:
        h, y = x, first_norm(x)
        for i, w in enumerate(weights):
            for j, sublayer in enumerate((lambda y: attention(w, y),
                                          lambda y: linear(w, "linear2")(gelu_tanh(linear(w, "linear1")(y))))):
                norm = norms_after_adds[2 * i + j]
                # h = h + sublayer(y), and its LayerNorm, in one pass over h
                y, h = layernorm.add_layer_norm(sublayer(y), h, (d_model,), norm["weight"], norm["bias"], 1e-5)
        return y

    x = np.random.default_rng(seed).standard_normal((batch, seq, d_model)).astype(np.float32)
    return Built(numpy_forward, torch_forward, x)


# ---------------------------------------------------------------------------------------------
# Llama style: RMSNorm, attention, RMSNorm, SwiGLU
# ---------------------------------------------------------------------------------------------

class LlamaBlock(nn.Module):
    """RMSNorm -> causal attention -> residual -> RMSNorm -> SwiGLU MLP -> residual."""

    def __init__(self, d_model: int, n_heads: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.attention_norm = nn.RMSNorm(d_model, eps=eps)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.ffn_norm = nn.RMSNorm(d_model, eps=eps)
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape

        def split(t):
            return t.view(batch, seq, self.n_heads, d // self.n_heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.wq(x)), split(self.wk(x)), split(self.wv(x)), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        n = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(n)) * self.w3(n))


def build_llama(d_model: int = 64, n_heads: int = 4, n_layers: int = 2, batch: int = 2, seq: int = 16,
                eps: float = 1e-6, seed: int = 0) -> Built:
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    blocks = nn.ModuleList(LlamaBlock(d_model, n_heads, 3 * d_model, eps) for _ in range(n_layers))
    final_norm = nn.RMSNorm(d_model, eps=eps)
    model = nn.ModuleDict({"blocks": blocks, "norm": final_norm}).eval()
    perturb_norms(model, generator)

    @torch.no_grad()
    def torch_forward(x: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            x = block(x)
        return final_norm(x)

    weights = [arrays(block) for block in blocks]
    first_norm = layernorm.RMSNorm(d_model, eps=eps).eval()
    first_norm.load_state_dict({"weight": weights[0]["attention_norm.weight"]})
    norms_after_adds = []
    for i, w in enumerate(weights):
        norms_after_adds.append(w["ffn_norm.weight"])
        norms_after_adds.append(arrays(final_norm)["weight"] if i + 1 == len(weights)
                                else weights[i + 1]["attention_norm.weight"])

    def attention(w, y):
        q, k, v = ((lambda t, name=name: t @ w[name + ".weight"].T) for name in ("wq", "wk", "wv"))
        return causal_attention(y, q, k, v, n_heads) @ w["wo.weight"].T

    def swiglu(w, y):
        return (silu(y @ w["w1.weight"].T) * (y @ w["w3.weight"].T)) @ w["w2.weight"].T

    def numpy_forward(x: np.ndarray) -> np.ndarray:
        h, y = x, first_norm(x)
        for i, w in enumerate(weights):
            for j, sublayer in enumerate((lambda y: attention(w, y), lambda y: swiglu(w, y))):
                # h = h + sublayer(y), and its RMSNorm, in one pass over h
                y, h = layernorm.add_rms_norm(sublayer(y), h, (d_model,), norms_after_adds[2 * i + j], eps)
        return y

    x = np.random.default_rng(seed).standard_normal((batch, seq, d_model)).astype(np.float32)
    return Built(numpy_forward, torch_forward, x)


def difference(built: Built) -> float:
    """max |NumPy - torch| / max |torch| on the built input."""
    ours = built.numpy(built.input)
    theirs = built.torch(torch.from_numpy(built.input)).numpy()
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    return float(np.abs(ours.astype(np.float64) - theirs).max() / np.abs(theirs).max())


def main() -> None:
    results = {name: difference(build()) for name, build in (("GPT-2", build_gpt2), ("Llama", build_llama))}
    for name, diff in results.items():
        if not diff <= TOLERANCE:
            raise SystemExit(f"{name} stack: NumPy differs from torch by {diff:.2e} of the largest output")
    print("transformer_blocks: NumPy matches torch, " +
          ", ".join(f"{name} {diff:.1e}" for name, diff in results.items()) + f" (tolerance {TOLERANCE:.0e})")


if __name__ == "__main__":
    main()
