"""GPT-2's training step as a sequential task flow: load, forward, loss, backward, update.

Each call on `ops` is one task (StarPUOps submits it, DirectOps runs it at once). StarPU infers
the task graph from the handles each task reads and writes, so this file is the whole
description of the graph (paper section 2, Figure 1):
  - activations carry forward -> backward dependencies, parameters update -> next forward,
    gradients backward -> update, targets load -> loss;
  - one update task per parameter tensor per layer, each ready as soon as its gradient is final.
Activation, input and target handles are created once and reused by every iteration (paper
section 2.3), so memory does not grow with the number of steps; the backward pass reuses one
set of scratch gradient buffers for all layers. The tensors are the named groups of
tensors.py: p, g, m, v ParameterTensors, a ActivationTensors, s BackwardScratch.
"""
from __future__ import annotations

from ..config import GPTConfig

ADAM_BETA1, ADAM_BETA2, ADAM_EPS = 0.9, 0.999, 1e-8


def forward(ops, cfg: GPTConfig, p, a, B: int, T: int):
    """Forward pass and loss: p are the parameters, a this batch's activations."""
    C, NH, L, V, Vp = cfg.C, cfg.NH, cfg.L, cfg.V, cfg.Vp
    BT = B * T
    ops.encoder_forward(a.encoded, a.inputs, p.wte, p.wpe, B, T, C)
    x = a.encoded
    for l in range(L):
        b = a.layer(l)
        block_forward(ops, cfg, p, l, x, b, BT,
                      lambda b: ops.attention_forward(b.atty, b.preatt, b.att, b.qkv, B, T, C, NH))
        x = b.res3
    ops.layernorm_forward(a.lnf, a.lnf_mean, a.lnf_rstd, x, p.lnfw, p.lnfb, BT, C)
    ops.matmul_forward(a.logits, a.lnf, p.wte, None, BT, C, Vp)   # lm head, tied to wte
    ops.crossentropy_forward(a.probs, a.losses, a.logits, a.targets, BT, V, Vp)


def block_forward(ops, cfg: GPTConfig, p, l: int, x, b, N: int, attention):
    """Transformer block l on N rows: x (N, C) in, b.res3 out. b names the block's buffers (the
    fields of ActivationTensors.layer(l)); attention(b) submits the attention from b.qkv to
    b.atty: over the sequences' own positions in training, over a key/value cache in
    generation (generate.py)."""
    C = cfg.C
    ops.layernorm_forward(b.ln1, b.ln1_mean, b.ln1_rstd, x, p.ln1w[l], p.ln1b[l], N, C)
    ops.matmul_forward(b.qkv, b.ln1, p.qkvw[l], p.qkvb[l], N, C, 3 * C)
    attention(b)
    ops.matmul_forward(b.attproj, b.atty, p.attprojw[l], p.attprojb[l], N, C, C)
    ops.residual_forward(b.res2, x, b.attproj, N * C)
    ops.layernorm_forward(b.ln2, b.ln2_mean, b.ln2_rstd, b.res2, p.ln2w[l], p.ln2b[l], N, C)
    ops.matmul_forward(b.fch, b.ln2, p.fcw[l], p.fcb[l], N, C, 4 * C)
    ops.gelu_forward(b.fch_gelu, b.fch, N * 4 * C)
    ops.matmul_forward(b.fcproj, b.fch_gelu, p.fcprojw[l], p.fcprojb[l], N, 4 * C, C)
    ops.residual_forward(b.res3, b.res2, b.fcproj, N * C)


def backward(ops, cfg: GPTConfig, p, g, a, s, B: int, T: int, dloss: float, redux: int):
    """Backward pass: accumulates into the parameter gradients g (RW, or REDUX when several
    sub-batches add into them). dloss scales the per-token loss gradient (1/(global B*T))."""
    C, NH, L, V, Vp = cfg.C, cfg.NH, cfg.L, cfg.V, cfg.Vp
    BT = B * T
    ops.crossentropy_backward(s.dlogits, a.probs, a.targets, BT, V, Vp, dloss)
    ops.matmul_backward(s.dln, g.wte, None, s.dlogits, a.lnf, p.wte, BT, C, Vp, redux)
    ops.layernorm_backward(s.dres, g.lnfw, g.lnfb, s.dln, a.res3[L - 1], p.lnfw,
                           a.lnf_mean, a.lnf_rstd, BT, C, 0, redux)
    # s.dres holds the gradient of the residual stream. A residual add passes its gradient
    # unchanged to both inputs, so the branch (fcproj, attproj) reads s.dres directly and the
    # layernorm of the other branch adds into it: no residual_backward copies.
    for l in reversed(range(L)):
        x = a.res3[l - 1] if l > 0 else a.encoded
        ops.matmul_backward(s.dfch_gelu, g.fcprojw[l], g.fcprojb[l], s.dres, a.fch_gelu[l],
                            p.fcprojw[l], BT, 4 * C, C, redux)
        ops.gelu_backward(s.dfch, a.fch[l], s.dfch_gelu, BT * 4 * C)
        ops.matmul_backward(s.dln, g.fcw[l], g.fcb[l], s.dfch, a.ln2[l], p.fcw[l], BT, C, 4 * C, redux)
        ops.layernorm_backward(s.dres, g.ln2w[l], g.ln2b[l], s.dln, a.res2[l], p.ln2w[l],
                               a.ln2_mean[l], a.ln2_rstd[l], BT, C, 1, redux)
        ops.matmul_backward(s.datty, g.attprojw[l], g.attprojb[l], s.dres, a.atty[l],
                            p.attprojw[l], BT, C, C, redux)
        ops.attention_backward(s.dqkv, s.att_scratch, s.datty, a.qkv[l], a.att[l], B, T, C, NH)
        ops.matmul_backward(s.dln, g.qkvw[l], g.qkvb[l], s.dqkv, a.ln1[l], p.qkvw[l], BT, C, 3 * C, redux)
        ops.layernorm_backward(s.dres, g.ln1w[l], g.ln1b[l], s.dln, x, p.ln1w[l],
                               a.ln1_mean[l], a.ln1_rstd[l], BT, C, 1, redux)
    ops.encoder_backward(g.wte, g.wpe, s.dres, a.inputs, B, T, C, redux)


LAYERED = ("ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
           "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb")


def update_order(cfg: GPTConfig):
    """(tensor name, layer or None) in the order their gradients become final in backward."""
    order = [("lnfw", None), ("lnfb", None)]
    for l in reversed(range(cfg.L)):
        order += [(name, l) for name in reversed(LAYERED)]
    return order + [("wpe", None), ("wte", None)]


def update(ops, cfg: GPTConfig, p, g, m, v, lr: float, weight_decay: float, t: int):
    """One AdamW task per parameter tensor per layer; each also zeroes its gradient."""
    for name, l in update_order(cfg):
        pt, gt, mt, vt = (getattr(ns, name) if l is None else getattr(ns, name)[l]
                          for ns in (p, g, m, v))
        ops.adamw(pt, gt, mt, vt, lr, ADAM_BETA1, ADAM_BETA2, ADAM_EPS, weight_decay, t)
