"""A PyTorch GPT-2 over llm.c's 16 parameter tensors: the oracle of the model tests (and
the `torch-readable` row of the bench). Needs torch (a test/bench-only dependency).

Written with explicit tensor ops (float32, CPU) so every layer is visible:
  x = wte[inputs] + wpe[:T]
  per block: x += attproj(attention(qkv(ln1(x))));  x += fcproj(gelu_tanh(fc(ln2(x))))
  logits = lnf(x) @ wte.T  (tied head, all Vp columns); loss = mean CE over logits[..., :V].
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..model.config import AdamW, GPTConfig
from .common import LN_EPS, batch, param_views, step_times

__all__ = ["TorchGPT2", "batch", "torch_train_step_times"]


class TorchGPT2:
    """GPT-2 whose parameters are torch leaf tensors named as in ParamLayout."""

    def __init__(self, config: GPTConfig, flat_params: np.ndarray):
        self.config = config
        self.layout, views = param_views(config, flat_params)
        self.params = {name: torch.from_numpy(view.copy()).requires_grad_(True)
                       for name, view in views.items()}
        self.optimizer = None

    # ------------------------------------------------------------------ model
    def _layernorm(self, x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b, eps=LN_EPS)

    def _attention(self, qkv, B, T):
        C, NH = self.config.C, self.config.NH
        hs = C // NH
        q, k, v = qkv.split(C, dim=-1)                               # each (B, T, C)
        q, k, v = (t.view(B, T, NH, hs).transpose(1, 2) for t in (q, k, v))  # (B, NH, T, hs)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))   # (B, NH, T, T)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        att = torch.softmax(scores, dim=-1)
        y = att @ v                                                  # (B, NH, T, hs)
        return y.transpose(1, 2).reshape(B, T, C)

    def forward(self, inputs, targets=None):
        """inputs, targets: (B, T) integer arrays. Returns (logits (B,T,Vp), loss or None)."""
        cfg, p = self.config, self.params
        inputs = torch.as_tensor(np.asarray(inputs, dtype=np.int64))
        B, T = inputs.shape
        x = p["wte"][inputs] + p["wpe"][:T]
        # one unbind per stacked (L, ...) tensor: its backward stacks the L gradients once
        # (indexing p[name][l] would zero-fill a whole (L, ...) gradient per layer)
        layer = {n: p[n].unbind(0) for n in self.layout.names if self.layout.is_layered(n)}
        for l in range(cfg.L):
            w = {n: t[l] for n, t in layer.items()}
            h = self._layernorm(x, w["ln1w"], w["ln1b"])
            qkv = F.linear(h, w["qkvw"], w["qkvb"])
            y = self._attention(qkv, B, T)
            x = x + F.linear(y, w["attprojw"], w["attprojb"])
            h = self._layernorm(x, w["ln2w"], w["ln2b"])
            h = F.gelu(F.linear(h, w["fcw"], w["fcb"]), approximate="tanh")
            x = x + F.linear(h, w["fcprojw"], w["fcprojb"])
        x = self._layernorm(x, p["lnfw"], p["lnfb"])
        logits = x @ p["wte"].T                                       # (B, T, Vp)
        loss = None
        if targets is not None:
            tgt = torch.as_tensor(np.asarray(targets, dtype=np.int64))
            loss = F.cross_entropy(logits[..., :cfg.V].reshape(B * T, cfg.V), tgt.reshape(-1))
        return logits, loss

    def forward_backward(self, inputs, targets):
        """Zero the gradients, run forward and backward; returns (logits numpy, loss float)."""
        for t in self.params.values():
            t.grad = None
        logits, loss = self.forward(inputs, targets)
        loss.backward()
        return logits.detach().numpy(), float(loss.detach())

    # ------------------------------------------------------------------ flat views
    def grads_flat(self) -> np.ndarray:
        """Gradients as one float32 array in ParamLayout order."""
        return np.concatenate([self.params[n].grad.detach().numpy().reshape(-1)
                               for n in self.layout.names]).astype(np.float32, copy=False)

    def params_flat(self) -> np.ndarray:
        return np.concatenate([self.params[n].detach().numpy().reshape(-1)
                               for n in self.layout.names]).astype(np.float32, copy=False)

    # ------------------------------------------------------------------ training
    def adamw_update(self, adamw: AdamW) -> float | None:
        """One torch.optim.AdamW step over all 16 tensors with the current gradients and
        adamw's settings (the weight decay on the tensors adamw.decays); adamw.grad_clip > 0
        clips the gradients' global norm to it first (torch.nn.utils.clip_grad_norm_: the
        engines' scale). Returns that norm before clipping (None without clipping)."""
        norm = None
        if adamw.grad_clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(
                [self.params[n] for n in self.layout.names], adamw.grad_clip))
        if self.optimizer is None:      # a group per tensor, named; each step sets its settings
            self.optimizer = torch.optim.AdamW(
                [{"params": [self.params[n]], "name": n} for n in self.layout.names])
        for group in self.optimizer.param_groups:
            group.update(lr=adamw.lr, betas=adamw.betas, eps=adamw.eps,
                         weight_decay=adamw.decay_of(group["name"]))
        self.optimizer.step()
        return norm

    def adamw_step(self, inputs, targets, adamw: AdamW) -> float:
        """forward + backward + AdamW update; returns the loss (as the engines' step())."""
        _, loss = self.forward_backward(inputs, targets)
        self.adamw_update(adamw)
        return loss


def torch_train_step_times(config: GPTConfig, flat_params: np.ndarray, tokens: np.ndarray,
                           B: int, T: int, steps: int, threads: int, lr: float = 1e-4):
    """Milliseconds of each of `steps` eager training steps (forward, backward, AdamW) on
    consecutive batches, with `threads` intra-op threads."""
    torch.set_num_threads(threads)
    return step_times(TorchGPT2(config, flat_params), tokens, B, T, steps, lr)
