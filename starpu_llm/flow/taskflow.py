"""GPT-2's training step as a sequential task flow: load, forward, loss, backward, update.

Each call on `ops` is one task of a codelet declared in csrc/codelets/ (runtime.submit.StarPUOps
submits it, codelets.DirectOps runs it at once; kernels/codelets.py gives the calling convention: buffers, then
arguments). StarPU infers
the task graph from the handles each task reads and writes, so this file is the whole
description of the graph (paper section 2, Figure 1):
  - activations carry forward -> backward dependencies, parameters update -> next forward,
    gradients backward -> update, targets load -> loss;
  - one update task per parameter tensor per layer, each ready as soon as its gradient is final
    (with gradient clipping: once every gradient is final and their norm computed, update());
  - a forward-only flow (forward() alone: validation) reads the parameters and writes the
    activations only.
Activation, input and target handles are created once and reused by every iteration (paper
section 2.3), so memory does not grow with the number of steps; the backward pass reuses one
set of scratch gradient buffers for all layers. The tensors are the named groups of
tensors.py: p, g, m, v ParameterTensors, a ActivationTensors, s BackwardScratch. wte (p.wte,
g.wte, ...) is the list of its row blocks, each a slice with its own update: the tasks that
use wte (the embedding, the lm head) take every block (one in a single process).
"""
from __future__ import annotations

from ..model.config import PARAMETERS, ROW_BLOCKED, AdamW, GPTConfig


def forward(ops, cfg: GPTConfig, p, a, B: int, T: int, head_ops=None, add_loss: bool = False):
    """Forward pass and loss: p are the parameters, a this batch's activations. head_ops
    (default ops) submits the head: the final layernorm, the lm head and the loss (a
    pipeline gives it its own priority). add_loss: each token's loss is added into a.losses
    (a gradient accumulation's later micro-batches: the step's sum), else written there."""
    C, NH, L, V, Vp = cfg.C, cfg.NH, cfg.L, cfg.V, cfg.Vp
    BT = B * T
    ops.encoder_forward(a.encoded, a.inputs, p.wte, p.wpe, B, T, C)
    x = a.encoded
    # the attention of a's form (tensors.ATTENTIONS): the fused one keeps the logsumexp in att
    attend = (ops.attention_flash_forward if a.attention == "flash" else ops.attention_forward)
    for l in range(L):
        b = a.layer(l)
        block_forward(ops, cfg, p, l, x, b, BT,
                      lambda b: attend(b.atty, b.att, b.qkv, B, T, C, NH))
        x = b.res3
    head = head_ops or ops
    head.layernorm_forward(a.lnf, a.lnf_mean, a.lnf_rstd, x, p.lnfw, p.lnfb, BT, C)
    head.matmul_forward(a.logits, a.lnf, p.wte, None, BT, C, Vp)   # lm head, tied to wte
    head.crossentropy_forward(a.probs, a.losses, a.logits, a.targets, BT, V, Vp, int(add_loss))


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


def backward(ops, cfg: GPTConfig, p, g, a, s, B: int, T: int, dloss: float, redux: int,
             layer_stage=None, embedding_wte=None, head_ops=None):
    """Backward pass: accumulates into the parameter gradients g (RW, or REDUX when sub-batches
    add into them through a StarPU reduction: topology.gradient_mode says when). dloss scales the
    per-token loss gradient (1/(global B*T)). s: the backward scratch of each pipeline stage
    (one without a pipeline); layer_stage[l] the stage of layer l (default: all on stage 0,
    which also runs the head and the embedding). Where the backward moves from one stage to
    the next, the residual stream's gradient is copied into the next stage's scratch: the one
    tensor that crosses (a transfer between ranks). embedding_wte: the tensor (its row blocks) the
    embedding adds its wte gradient into (default g.wte, which the lm head adds into first). A pipeline
    gives it its own, added into g.wte after the backward (reduce_gradients): with one worker
    the contributions are chained in submission order, and one chain through the head's and
    the embedding's would keep micro-batch m+1's backward (its head's, first) waiting for m's
    whole backward (its embedding's, last). head_ops (default ops) submits the head's backward:
    the loss, the lm head and the final layernorm (a pipeline gives it its own priority)."""
    C, NH, L, V, Vp = cfg.C, cfg.NH, cfg.L, cfg.V, cfg.Vp
    BT = B * T
    stage_of = layer_stage or (0,) * L
    head = cur = s[0]
    hops = head_ops or ops
    hops.crossentropy_backward(head.dlogits, a.probs, a.targets, BT, V, Vp, dloss)
    hops.matmul_backward(head.dln, g.wte, head.dlogits, a.lnf, p.wte, None, BT, C, Vp,
                         redux=redux)
    hops.layernorm_backward(head.dres, g.lnfw, g.lnfb, head.dln, a.res3[L - 1], p.lnfw,
                            a.lnf_mean, a.lnf_rstd, BT, C, 0, redux=redux)
    # s.dres holds the gradient of the residual stream. A residual add passes its gradient
    # unchanged to both inputs, so the branch (fcproj, attproj) reads s.dres directly and the
    # layernorm of the other branch adds into it: no residual_backward copies.
    for l in reversed(range(L)):
        if s[stage_of[l]] is not cur:
            # the head's gradient handed to the last stage goes with the head's backward
            (hops if cur is head else ops).copy(s[stage_of[l]].dres, cur.dres)
            cur = s[stage_of[l]]
        x = a.res3[l - 1] if l > 0 else a.encoded
        ops.matmul_backward(cur.dfch_gelu, g.fcprojw[l], cur.dres, a.fch_gelu[l], p.fcprojw[l],
                            g.fcprojb[l], BT, 4 * C, C, redux=redux)
        ops.gelu_backward(cur.dfch, a.fch[l], cur.dfch_gelu, BT * 4 * C)
        ops.matmul_backward(cur.dln, g.fcw[l], cur.dfch, a.ln2[l], p.fcw[l], g.fcb[l], BT, C,
                            4 * C, redux=redux)
        ops.layernorm_backward(cur.dres, g.ln2w[l], g.ln2b[l], cur.dln, a.res2[l], p.ln2w[l],
                               a.ln2_mean[l], a.ln2_rstd[l], BT, C, 1, redux=redux)
        ops.matmul_backward(cur.datty, g.attprojw[l], cur.dres, a.atty[l], p.attprojw[l],
                            g.attprojb[l], BT, C, C, redux=redux)
        if a.attention == "flash":
            ops.attention_flash_backward(cur.dqkv, cur.att_scratch, cur.datty, a.qkv[l],
                                         a.atty[l], a.att[l], B, T, C, NH)
        else:
            ops.attention_backward(cur.dqkv, cur.att_scratch, cur.datty, a.qkv[l], a.att[l], B,
                                   T, C, NH)
        ops.matmul_backward(cur.dln, g.qkvw[l], cur.dqkv, a.ln1[l], p.qkvw[l], g.qkvb[l], BT, C,
                            3 * C, redux=redux)
        ops.layernorm_backward(cur.dres, g.ln1w[l], g.ln1b[l], cur.dln, x, p.ln1w[l],
                               a.ln1_mean[l], a.ln1_rstd[l], BT, C, 1, redux=redux)
    if cur is not head:
        ops.copy(head.dres, cur.dres)
    ops.encoder_backward(g.wte if embedding_wte is None else embedding_wte, g.wpe, head.dres,
                         a.inputs, B, T, C, redux=redux)


def reduce_gradients(ops, cfg: GPTConfig, g, contributions, embedding_wte=None):
    """After the backward passes: each copy's embedding wte gradient (embedding_wte[d], a
    pipeline's: backward) added into its wte contribution and zeroed, block by block; then each copy's
    contribution to a gradient slice (contributions[d], handles.Handles.contributions; the
    slices a copy's rank owns are the gradients themselves) added into the slice, on its
    owner, in copy order: a fixed sum, the same in every run; then zeroed for the next step.
    In update order, so the slices final first are reduced first."""
    for c, e in zip(contributions, embedding_wte or []):
        for ct, et in zip(c.wte, e):
            ops.add(ct, et)
            ops.zero(et)
    for name, l in update_order(cfg, len(g.wte)):
        gt = _slice(g, name, l)
        for c in contributions:
            ct = _slice(c, name, l)
            if ct is not gt:
                ops.add(gt, ct)
                ops.zero(ct)


def _slice(group, name, l):
    """Slice (name, l) of a ParameterTensors group: layer l's of a block tensor, wte's row
    block l, or the tensor (l None)."""
    t = getattr(group, name)
    return t if l is None else t[l]


def update_order(cfg: GPTConfig, wte_blocks: int = 1):
    """The parameter slices, (tensor name, layer or wte's row block, else None), in the order
    their gradients become final in backward: config.PARAMETERS backwards (head, blocks from
    the last layer to the first, embedding: wte's wte_blocks row blocks in order)."""
    def part(name):
        return [p.name for p in reversed(PARAMETERS) if p.part == name]
    return ([(name, None) for name in part("head")]
            + [(name, l) for l in reversed(range(cfg.L)) for name in part("block")]
            + [(name, b) for name in part("embedding")
               for b in (range(wte_blocks) if name == ROW_BLOCKED else [None])])


NORM_FANIN = 7   # inputs of one norm_sum task: a task has at most 8 buffers (Debian's StarPU 1.3)


def norm_tree(n: int, fanin: int = NORM_FANIN):
    """The sums that reduce n partial sums of squares to one: [(inputs, out)], node out = the
    nodes inputs added in order. Nodes 0 .. n-1 are the partials; each sum's out is the next
    node; the last node is the root (node 0 when n == 1). A group of one moves up as is."""
    sums, level, nxt = [], list(range(n)), n
    while len(level) > 1:
        up = []
        for i in range(0, len(level), fanin):
            group = tuple(level[i:i + fanin])
            if len(group) == 1:
                up.append(group[0])
                continue
            sums.append((group, nxt))
            up.append(nxt)
            nxt += 1
        level = up
    return sums


def norm_nodes(cfg: GPTConfig, wte_blocks: int = 1) -> int:
    """Scalars of the gradient norm's tree: one partial per update, the sums' outputs."""
    n = len(update_order(cfg, wte_blocks))
    return n + len(norm_tree(n))


def update(ops, cfg: GPTConfig, p, g, m, v, adamw: AdamW, t: int, norm=None):
    """One AdamW task per parameter tensor per layer, with the settings adamw holds (t: the
    update's number, 1-based); each also zeroes its gradient. The weight decay shrinks the
    tensors of DECAYED[adamw.decayed] (config.py) only.

    adamw.grad_clip > 0: the gradients are first scaled by min(1, grad_clip / (||g|| + 1e-6)),
    ||g|| the L2 norm of all of them (torch.nn.utils.clip_grad_norm_). norm: norm_nodes(cfg)
    scalars (float64); a grad_sumsq task per tensor writes its partial sum of squares as soon
    as its gradient is final, norm_sum tasks add them up (norm_tree), and every AdamW task
    reads the root. Without clipping an update depends on its own gradient only."""
    names = update_order(cfg, len(p.wte))
    order = [tuple(_slice(ns, name, l) for ns in (p, g, m, v)) for name, l in names]
    root = None
    if adamw.grad_clip > 0:
        for k, (_, gt, _, _) in enumerate(order):
            ops.grad_sumsq(norm[k], gt)
        for inputs, out in norm_tree(len(order)):
            ops.norm_sum(norm[out], [norm[k] for k in inputs])
        root = norm[-1]
    for (pt, gt, mt, vt), (name, _) in zip(order, names):
        ops.adamw(pt, gt, mt, vt, root, adamw.lr, *adamw.betas, adamw.eps, adamw.decay_of(name),
                  t, adamw.grad_clip if root is not None else 0.0)
