"""GPT-2 in eager PyTorch, written the standard way for speed: the bench's PyTorch series.

What a user who wants a fast eager GPT-2 on a CPU writes (nanoGPT's formulation):
  - one leaf tensor per layer and weight (as nn.Linear holds them), applied with F.linear;
  - attention through F.scaled_dot_product_attention(q, k, v, is_causal=True) (PyTorch's
    fused flash-attention CPU kernel: no (T, T) mask, no materialised scores in eager ops);
  - the lm head tied to wte: F.linear(x, wte[:V]), the real vocabulary only (wte's padded rows
    are 0 and never reach the loss, so this is the same math as llm.c's Vp columns);
  - AdamW with fused=True (foreach where the fused CPU kernel is not available);
  - torch.set_num_threads(cores used).
Weights come in and go out in llm.c's flat layout (config.ParamLayout), so it trains from
exactly the same parameters as the engines and the readable oracle (starpu_llm.baselines.torch_gpt2),
against which tests/test_baselines.py checks it.
"""
from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F

from ..model.config import AdamW, GPTConfig
from .common import LN_EPS, param_views, step_times


def _adamw(groups):
    """torch's AdamW over groups, fused where it can be (foreach where not); each step sets
    the groups' settings (SdpaGPT2.adamw_update)."""
    try:
        return torch.optim.AdamW(groups, fused=True), "fused"
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(groups, foreach=True), "foreach"


class SdpaGPT2:
    """GPT-2 with per-layer leaf tensors, SDPA attention and a fused AdamW."""

    def __init__(self, config: GPTConfig, flat_params: np.ndarray, device: str = "cpu"):
        """device: where the parameters, the batch and the work go ("cuda": a GPU; the
        caller chooses TF32 with torch.backends.cuda.matmul.allow_tf32)."""
        self.config, self.device = config, torch.device(device)
        self.layout, views = param_views(config, flat_params)
        leaf = lambda a: torch.from_numpy(np.ascontiguousarray(a).copy()).to(  # noqa: E731
            self.device).requires_grad_(True)
        # {name: tensor} for the unstacked ones, {name: [L tensors]} for the per-layer ones
        self.params = {n: ([leaf(v[l]) for l in range(config.L)] if self.layout.is_layered(n)
                           else leaf(v)) for n, v in views.items()}
        self.optimizer = None
        self.optimizer_kind = None

    def named_parameters(self):
        """(name, leaf tensor) of every leaf tensor, in ParamLayout order (per-layer ones
        layer by layer)."""
        for n in self.layout.names:
            p = self.params[n]
            yield from ((n, t) for t in (p if isinstance(p, list) else [p]))

    def parameters(self):
        """Every leaf tensor, in ParamLayout order (per-layer ones layer by layer)."""
        return (t for _, t in self.named_parameters())

    def forward(self, inputs, targets=None):
        """inputs, targets: (B, T) integer arrays or tensors. Returns (logits (B,T,V), loss)."""
        cfg, p = self.config, self.params
        C, NH, V = cfg.C, cfg.NH, cfg.V
        idx = torch.as_tensor(np.asarray(inputs, dtype=np.int64), device=self.device)
        B, T = idx.shape
        x = F.embedding(idx, p["wte"]) + p["wpe"][:T]
        for l in range(cfg.L):
            h = F.layer_norm(x, (C,), p["ln1w"][l], p["ln1b"][l], LN_EPS)
            q, k, v = F.linear(h, p["qkvw"][l], p["qkvb"][l]).split(C, dim=2)
            q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            x = x + F.linear(y, p["attprojw"][l], p["attprojb"][l])
            h = F.layer_norm(x, (C,), p["ln2w"][l], p["ln2b"][l], LN_EPS)
            h = F.gelu(F.linear(h, p["fcw"][l], p["fcb"][l]), approximate="tanh")
            x = x + F.linear(h, p["fcprojw"][l], p["fcprojb"][l])
        x = F.layer_norm(x, (C,), p["lnfw"], p["lnfb"], LN_EPS)
        logits = F.linear(x, p["wte"][:V])
        loss = None
        if targets is not None:
            tgt = torch.as_tensor(np.asarray(targets, dtype=np.int64), device=self.device)
            loss = F.cross_entropy(logits.view(B * T, V), tgt.view(-1))
        return logits, loss

    def forward_backward(self, inputs, targets):
        """Forward and backward from zero gradients; returns (logits numpy, loss float)."""
        for t in self.parameters():
            t.grad = None
        logits, loss = self.forward(inputs, targets)
        loss.backward()
        return logits.detach().cpu().numpy(), float(loss.detach())

    def adamw_update(self, adamw: AdamW):
        """nanoGPT's AdamW with adamw's settings: two groups, the tensors adamw decays (at the
        first update) and the others, the weight decay on the first (nanoGPT's: the 2-D
        tensors, not the biases nor the layernorms); adamw.grad_clip > 0 clips the gradients'
        global norm to it first."""
        if adamw.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(list(self.parameters()), adamw.grad_clip)
        if self.optimizer is None:
            named = list(self.named_parameters())
            self.optimizer, self.optimizer_kind = _adamw(
                [{"params": [t for n, t in named if adamw.decays(n) == d], "decays": d}
                 for d in (True, False)])
        for group in self.optimizer.param_groups:
            group.update(lr=adamw.lr, betas=adamw.betas, eps=adamw.eps,
                         weight_decay=adamw.weight_decay if group["decays"] else 0.0)
        self.optimizer.step()

    def adamw_step(self, inputs, targets, adamw: AdamW) -> float:
        for t in self.parameters():
            t.grad = None
        _, loss = self.forward(inputs, targets)
        loss.backward()
        self.adamw_update(adamw)
        return float(loss.detach())

    # --- flat llm.c-layout views (for the tests) ---
    def _flat(self, get) -> np.ndarray:
        out = []
        for n in self.layout.names:
            p = self.params[n]
            out += [get(t).reshape(-1) for t in (p if isinstance(p, list) else [p])]
        return np.concatenate(out).astype(np.float32, copy=False)

    def params_flat(self) -> np.ndarray:
        return self._flat(lambda t: t.detach().cpu().numpy())

    def grads_flat(self) -> np.ndarray:
        return self._flat(lambda t: t.grad.detach().cpu().numpy())

    def state_flat(self, key: str) -> np.ndarray:
        """An AdamW state ("exp_avg" or "exp_avg_sq") in llm.c's layout."""
        return self._flat(lambda t: self.optimizer.state[t][key].cpu().numpy())


def torch_train_step_times(config: GPTConfig, flat_params: np.ndarray, tokens: np.ndarray,
                           B: int, T: int, steps: int, threads: int, lr: float = 1e-4):
    """Milliseconds of each of `steps` eager training steps (forward, backward, AdamW) on
    consecutive batches, with `threads` intra-op threads (as torch_gpt2's)."""
    torch.set_num_threads(threads)
    return step_times(SdpaGPT2(config, flat_params), tokens, B, T, steps, lr)
