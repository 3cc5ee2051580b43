"""Each codelet is declared once, in the C codelet table (SL_CODELET): its access modes, its
argument struct, its flop count, its body. The one submission path builds its tasks from that
table, and both Python executors are derived from it: StarPU must have run every task of a
real step with exactly the declared modes (read back from the running task by the trace)."""
import threading

import numpy as np
import pytest

from starpu_llm import Runtime
from starpu_llm._clib import ffi, lib
from starpu_llm.kernels.codelets import DirectOps, TableError, read_table, TABLE as KERNEL_TABLE
from starpu_llm.runtime.submit import TABLE, StarPUOps, Where
from starpu_llm.model.config import MODELS
from starpu_llm.runtime import usable_cores
from partitions import here
from tracing import traced_step

MICRO = MODELS["micro"]
TOKENS = np.random.default_rng(0).integers(0, MICRO.V, 4000).astype(np.uint16)
MAX_REPEATS = 8      # the repeat counts tried by allowed()


def declared(codelet, redux, accumulate):
    """The codelet's declared SL_ACCESS_* modes for a task with this redux / accumulate."""
    modes = ffi.new("int32_t[]", lib.SL_MAX_BUFFERS)
    n = lib.sl_codelet_modes(codelet, redux, accumulate, modes, lib.SL_MAX_BUFFERS)
    assert 0 <= n <= lib.SL_MAX_BUFFERS, n
    return [int(m) for m in modes[0:n]]


def allowed(codelet, redux):
    """Every mode list a task of the codelet may run with in a step of this redux: either
    accumulate, with or without its optional trailing buffers (any number of the last), each
    repeated buffer k times in its place (k = 1 .. MAX_REPEATS, the same for all)."""
    out = set()
    flags = lib.SL_ACCESS_OPTIONAL | lib.SL_ACCESS_REPEAT | lib.SL_ACCESS_ANY
    for accumulate in (0, 1):
        modes = declared(codelet, redux, accumulate)
        for k in range(1, MAX_REPEATS + 1):
            places = [k if m & lib.SL_ACCESS_REPEAT else 1 for m in modes]
            full = tuple(m & ~flags for m, p in zip(modes, places) for _ in range(p))
            out.add(full)
            n = len(modes)
            while n and modes[n - 1] & lib.SL_ACCESS_OPTIONAL:
                n -= 1
                out.add(full[:sum(places[:n])])
    return out


def test_declared_table():
    ids = {ffi.string(lib.sl_codelet_name(i)).decode(): i for i in range(lib.sl_codelet_count())}
    r, w, rw, redux = lib.SL_ACCESS_R, lib.SL_ACCESS_W, lib.SL_ACCESS_R | lib.SL_ACCESS_W, lib.SL_ACCESS_REDUX
    opt = lib.SL_ACCESS_OPTIONAL
    assert declared(ids["adamw"], 0, 0) == [rw] * 4 + [r | opt]     # [the gradient norm]
    assert declared(ids["grad_sumsq"], 0, 0) == [w, r]
    assert declared(ids["norm_sum"], 0, 0) == [w, r | lib.SL_ACCESS_REPEAT]
    assert declared(ids["gather"], 0, 0) == [w | lib.SL_ACCESS_ANY, r | lib.SL_ACCESS_REPEAT]
    rep = lib.SL_ACCESS_REPEAT          # the weight and its gradient: in row blocks (wte)
    assert declared(ids["matmul_backward"], 0, 0) == [w, rw | rep, r, r, r | rep, rw | opt]
    assert declared(ids["matmul_backward"], 1, 0) == [w, redux | rep, r, r, r | rep, redux | opt]
    assert declared(ids["encoder_backward"], 1, 0) == [redux | rep, redux, r, r]
    # dinp (W, or RW when it adds into the residual's gradient), dweight and dbias (added
    # into: RW, or a reduction across sub-batches), then what it reads
    for redux_grads, accumulate in ((0, 0), (0, 1), (1, 0), (1, 1)):
        grad = redux if redux_grads else rw
        assert declared(ids["layernorm_backward"], redux_grads, accumulate) == \
            [rw if accumulate else w, grad, grad] + [r] * 5, (redux_grads, accumulate)
    assert lib.sl_codelet_modes(lib.sl_codelet_count(), 0, 0, ffi.NULL, 0) < 0


# redux: the gradients' mode the placement gives these sub-batches: a StarPU reduction when
# each of 2 one-core workers runs one sub-batch, a chain (RW) when they share the one worker
@pytest.mark.parametrize("workers,sub_batches,redux,grad_clip", [
    (1, None, 0, 0.0), (1, 2, 0, 0.0), (2, None, 1, 0.0), (2, None, 1, 1.0)])
def test_traced_modes_are_the_declared_ones(workers, sub_batches, redux, grad_clip):
    if workers > usable_cores():
        pytest.skip(f"{workers} one-core workers need {workers} cores; this process may use "
                    f"{usable_cores()}")
    with Runtime(here(workers, 1)) as rt:
        events, _ = traced_step(rt, MICRO, TOKENS, sub_batches=sub_batches, grad_clip=grad_clip)
    ids = {ffi.string(lib.sl_codelet_name(i)).decode(): i for i in range(lib.sl_codelet_count())}
    seen = set()
    for name, _, _, _, _, buffers, *_ in events:
        if buffers is None:   # a reduction method StarPU ran inline inside another task
            continue
        modes = tuple(m for _, m in buffers)
        variants = allowed(ids[name], redux)
        assert modes in variants, (name, modes, variants)
        seen.add((name, modes))
    names = {n for n, _ in seen}
    assert {"load_batch", "encoder_forward", "encoder_backward", "matmul_forward",
            "matmul_backward", "attention_backward", "layernorm_backward", "adamw"} <= names
    # both variants of the per-task modes ran: with and without bias, accumulate 0 and 1
    assert {len(m) for n, m in seen if n == "matmul_backward"} == {5, 6}
    assert {m[0] for n, m in seen if n == "layernorm_backward"} == {
        lib.SL_ACCESS_W, lib.SL_ACCESS_R | lib.SL_ACCESS_W}
    # the update reads the gradient norm exactly when clipping; the norm's tasks ran then only
    assert {len(m) for n, m in seen if n == "adamw"} == ({5} if grad_clip else {4})
    assert ({"grad_sumsq", "norm_sum"} <= names) == bool(grad_clip)


def test_wte_blocks_run_with_every_buffer():
    """wte in 5 row blocks (the engine's override; under mpirun the placement's), one
    process: the embedding and the lm head take every block, StarPU runs each task with all
    its buffers in the declared modes, each repeated one 5 times in its place (the lm head's
    backward has 3 + 2 x 5 = 13 buffers, past the 8 a task may have on Debian's StarPU 1.3
    without STARPU_VARIABLE_NBUFFERS), and every block gets its own update."""
    with Runtime(here(1, 1)) as rt:
        events, names = traced_step(rt, MICRO, TOKENS, wte_blocks=5)
    ids = {ffi.string(lib.sl_codelet_name(i)).decode(): i for i in range(lib.sl_codelet_count())}
    counts = {}
    for name, _, _, _, _, buffers, *_ in events:
        if buffers is None:
            continue
        assert tuple(m for _, m in buffers) in allowed(ids[name], 0), name
        wte = [names[h] for h, _ in buffers if ".wte[" in names[h]]
        counts.setdefault(name, set()).add((len(buffers), len(wte)))
    assert counts["matmul_backward"] >= {(13, 10), (6, 0)}     # the head, and a layer's
    assert counts["matmul_forward"] >= {(7, 5), (4, 0)}
    assert counts["encoder_forward"] == {(8, 5)} and counts["encoder_backward"] == {(8, 5)}
    assert (4, 4) in counts["adamw"]          # a block's parameter, gradient, m and v
    updated = [names[e[5][0][0]] for e in events if e[0] == "adamw"]
    assert sorted(n for n in updated if ".wte" in n) == [f"param.wte[{b}]" for b in range(5)]


def test_submission_checks_the_repeat_count():
    """Every repeated buffer of a call comes as often as the others (split_call), and as often
    as the task's count says (sl_submit)."""
    with pytest.raises(TypeError, match="different counts"):
        DirectOps().matmul_backward(None, [1, 2], None, None, [1, 2, 3], None, 1, 1, 1)
    with Runtime(here(1, 1)) as rt:
        arrays = [np.ones(4, np.float32) for _ in range(4)]
        h = [lib.sl_register_vector(ffi.from_buffer(x), 4, 4) for x in arrays]
        cd = TABLE["matmul_forward"]
        hs = ffi.new("sl_handle[]", h)
        owner, any_ = lib.SL_NODE_OWNER, lib.SL_ANY_WORKER
        for blocks, n in ((2, 3), (0, 2), (3, 4)):      # 2 blocks, 3 buffers: 1 block missing
            a = ffi.new(cd.args_type + " *", [1, 2, 4, blocks])
            assert lib.sl_submit(cd.id, hs, n, 0, a, cd.args_size, owner, any_, 0) < 0
        # out (N=1, OC=4) = inp (1, C=2) @ weight^T, weight (4, 2) in 2 blocks of 2 rows
        a = ffi.new(cd.args_type + " *", [1, 2, 4, 2])
        assert lib.sl_submit(cd.id, hs, 4, 0, a, cd.args_size, owner, any_, 0) == 0
        rt.wait()
        for x in h:
            lib.sl_unregister(x)
    assert np.array_equal(arrays[0], np.full(4, 2.0, np.float32))


def test_both_executors_come_from_the_one_table():
    """The StarPU and the direct executor have a method for every codelet of the table, the
    same table in both binding modules; a call's scalars are the codelet's argument struct."""
    assert TABLE == KERNEL_TABLE
    assert len(TABLE) == lib.sl_codelet_count() > 20
    for name, cd in TABLE.items():
        assert callable(getattr(StarPUOps, name)) and callable(getattr(DirectOps, name)), name
        assert ffi.string(lib.sl_codelet_name(cd.id)).decode() == name
    assert TABLE["matmul_forward"].fields == ("N", "C", "OC")
    assert TABLE["adamw"].fields[-1] == "max_norm"
    assert TABLE["norm_sum"].repeat and not TABLE["adamw"].repeat
    with pytest.raises(TypeError, match="missing"):
        DirectOps().gelu_forward(None, None)          # no N
    with pytest.raises(TypeError, match="unexpected"):
        DirectOps().gelu_forward(None, None, 3, 4)


class _Misdeclared:
    """The C table as lib gives it, but for one codelet: another's name (a copied codelet
    file not renamed) or an argument struct that sl_codelets.h lacks."""

    def __init__(self, victim, name=None, args_type=None):
        self.victim, self.name, self.args_type = TABLE[victim].id, name, args_type

    def __getattr__(self, attr):
        return getattr(lib, attr)

    def sl_codelet_name(self, i):
        return ffi.new("char[]", self.name.encode()) if i == self.victim and self.name \
            else lib.sl_codelet_name(i)

    def sl_codelet_args_type(self, i):
        return ffi.new("char[]", self.args_type.encode()) \
            if i == self.victim and self.args_type else lib.sl_codelet_args_type(i)


def test_a_misdeclared_codelet_is_named_at_import():
    """A codelet declared twice under one name would hide the other one in the table; an
    argument struct outside sl_codelets.h is unknown to cffi: each is one error naming the
    codelet and what to change, where a raw cffi error or nothing came before."""
    assert read_table(ffi, _Misdeclared("residual_forward")) == TABLE
    with pytest.raises(TableError, match=r"codelet gelu_forward is declared twice.*rename"):
        read_table(ffi, _Misdeclared("residual_forward", name="gelu_forward"))
    with pytest.raises(TableError, match=r"codelet residual_forward's arguments, struct "
                                         r"sl_relu_args, .*csrc/codelets/sl_codelets.h"):
        read_table(ffi, _Misdeclared("residual_forward", args_type="struct sl_relu_args"))


def test_flops_come_from_the_declaration():
    """The flop count StarPU gets is the declaration's: 2 N C OC (+ N OC with a bias), whether
    the weight comes whole or in row blocks (the last field, blocks, is the repeat count)."""
    cd = TABLE["matmul_forward"]
    a = ffi.new(cd.args_type + " *", [3, 4, 5, 1])
    with_bias = ffi.new("size_t[]", [15, 12, 20, 5])
    assert lib.sl_codelet_flops(cd.id, with_bias, 4, a) == 2 * 3 * 4 * 5 + 3 * 5
    assert lib.sl_codelet_flops(cd.id, with_bias, 3, a) == 2 * 3 * 4 * 5
    two_blocks = ffi.new(cd.args_type + " *", [3, 4, 5, 2])
    assert lib.sl_codelet_flops(cd.id, ffi.new("size_t[]", [15, 12, 8, 12]), 4,
                                two_blocks) == 2 * 3 * 4 * 5
    assert lib.sl_codelet_flops(TABLE["gelu_forward"].id, with_bias, 2, ffi.NULL) == 0


def test_attention_flops_count_the_causal_pairs():
    """The attention's flops: B NH T(T+1)/2 (query, key) pairs of hs-long products, two per
    pair forward (q.k, a v) and four backward; the fused backward five (it recomputes q.k),
    counted by brute force over the pairs."""
    B, T, C, NH = 2, 5, 12, 3
    hs = C // NH
    pairs = sum(1 for _ in range(B) for _ in range(NH) for t in range(T) for _ in range(t + 1))
    for name, products in (("attention_forward", 2), ("attention_backward", 4),
                           ("attention_flash_forward", 2), ("attention_flash_backward", 5)):
        cd = TABLE[name]
        a = ffi.new(cd.args_type + " *", dict(B=B, T=T, C=C, NH=NH))
        counts = ffi.new("size_t[]", [1] * cd.nbuffers)
        assert lib.sl_codelet_flops(cd.id, counts, cd.nbuffers, a) == pairs * products * 2 * hs


def test_submission_checks_the_declaration_and_the_site():
    """sl_submit refuses a task that does not match the declaration (a missing buffer, too
    many, arguments of the wrong size) or a site that cannot be (node or worker below -1)."""
    with Runtime(here(1, 1)) as rt:
        arrays = [np.ones(4, np.float32) for _ in range(3)]
        h = [lib.sl_register_vector(ffi.from_buffer(x), 4, 4) for x in arrays]
        cd = TABLE["gelu_forward"]
        a = ffi.new(cd.args_type + " *", [4])
        size = ffi.sizeof(cd.args_type)
        hs = ffi.new("sl_handle[]", h)
        any_, owner = lib.SL_ANY_WORKER, lib.SL_NODE_OWNER
        assert lib.sl_submit(cd.id, hs, 1, 0, a, size, owner, any_, 0) < 0      # inp missing
        assert lib.sl_submit(cd.id, hs, 3, 0, a, size, owner, any_, 0) < 0      # one too many
        assert lib.sl_submit(cd.id, hs, 2, 0, a, size - 1, owner, any_, 0) < 0  # wrong args
        assert lib.sl_submit(cd.id, hs, 2, 0, a, size, -2, any_, 0) < 0
        assert lib.sl_submit(cd.id, hs, 2, 0, a, size, owner, -2, 0) < 0
        assert lib.sl_submit(lib.sl_codelet_count(), hs, 2, 0, a, size, owner, any_, 0) < 0
        assert lib.sl_submit(cd.id, hs, 2, 0, a, size, owner, any_, 0) == 0
        rt.wait()
        for x in h:
            lib.sl_unregister(x)
    assert np.all(arrays[0] > 0.8) and np.all(arrays[2] == 1)   # gelu(1) ran once, into h[0]


def test_each_task_runs_where_its_submission_says():
    """Placement is an argument of each submission: probe tasks given worker 0 or 1 run on
    that worker, in any order of submission (no state carried from one task to the next)."""
    if usable_cores() < 2:
        pytest.skip("two one-core workers need two cores")
    with Runtime(here(2, 1)) as rt:
        rt.start_trace(1000)
        outs = []
        for i in range(40):
            out = ffi.new("uint64_t[]", 2)
            outs.append(out)
            StarPUOps(where=Where(worker=(i * 7) % 3 % 2)).probe(out, 1)
        rt.wait()
        events = rt.trace()
        rt.stop_trace()
    probes = sorted((e.job, e.worker) for e in events if e.codelet == "probe")
    assert len(probes) == 40
    assert [w for _, w in probes] == [(i * 7) % 3 % 2 for i in range(40)]


PRIORITIES = [0, 1, 2, 0, 3, 1, 2, 0]


def test_tasks_ready_together_run_highest_priority_first():
    """The priority is an argument of each submission, and the default scheduler honours
    it: tasks that become ready together on one worker (all reading what one gate task
    writes) run highest priority first, in submission order within a priority (lws pops its
    worker's queue by priority, StarPU 1.3 and 1.4 alike). The gate waits for this thread to
    release its input, so every task is submitted before any can run; the worker running the
    gate makes them all ready before it takes the next task."""
    with Runtime(here(1, 1, sched="lws")) as rt:
        arrays = [np.ones(64, np.float32) for _ in range(2 + len(PRIORITIES))]
        hs = [lib.sl_register_vector(ffi.from_buffer(x), x.size, 4) for x in arrays]
        gate_in, gate_out, outs = hs[0], hs[1], hs[2:]
        rt.start_trace(100)
        assert lib.sl_acquire(gate_in, 3) != ffi.NULL     # held: the gate waits for it
        StarPUOps().gelu_forward(gate_out, gate_in, 64)
        for h, prio in zip(outs, PRIORITIES):
            StarPUOps(where=Where(priority=prio)).gelu_forward(h, gate_out, 64)
        lib.sl_release(gate_in)
        rt.wait()
        events = rt.trace()
        rt.stop_trace()
        for h in hs:
            lib.sl_unregister(h)
    ran = [(e.priority, e.job) for e in sorted(events, key=lambda e: e.start_ns)][1:]
    assert sorted(p for p, _ in ran) == sorted(PRIORITIES)
    assert ran == sorted(ran, key=lambda pj: (-pj[0], pj[1])), ran


def test_a_repeated_buffer_past_the_declared_maximum():
    """A repeated last buffer may come more times than a codelet can declare buffers
    (SL_MAX_BUFFERS): the gather of a checkpoint snapshot reads every parameter tensor."""
    k = lib.SL_MAX_BUFFERS + 4
    sources = [np.full(3, i, np.float32) for i in range(k)]
    dst = np.zeros(3 * k, np.float32)
    with Runtime(here(1, 1)) as rt:
        hs = [lib.sl_register_vector(ffi.from_buffer(x), x.size, 4) for x in [dst, *sources]]
        StarPUOps().gather(hs[0], hs[1:], ffi.cast("char *", ffi.from_buffer(dst)))
        rt.wait()
        for h in hs:
            lib.sl_unregister(h)
    assert np.array_equal(dst, np.repeat(np.arange(k, dtype=np.float32), 3))


def test_threads_submitting_at_once_keep_their_arguments():
    """StarPUOps reuses its cffi buffers from task to task, one set per thread (cffi lets
    another thread run during sl_submit): two threads submitting gelu tasks at once, one
    with N=8 and one with N=4 over 8-element vectors, each task sees its own N (with one
    set shared by both, 32 tasks of these 6000 got the other thread's N in a trial run)."""
    k = 3000
    with Runtime(here(1, 1)) as rt:
        arrays = {N: [(np.ones(8, np.float32), np.full(8, np.nan, np.float32)) for _ in range(k)]
                  for N in (8, 4)}
        handles = {N: [tuple(lib.sl_register_vector(ffi.from_buffer(x), 8, 4) for x in pair)
                       for pair in pairs] for N, pairs in arrays.items()}

        def submit(N):
            ops = StarPUOps()
            for inp, out in handles[N]:
                ops.gelu_forward(out, inp, N)
        threads = [threading.Thread(target=submit, args=(N,)) for N in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rt.wait()
        for pairs in handles.values():
            for pair in pairs:
                for h in pair:
                    lib.sl_unregister(h)
    for N, pairs in arrays.items():
        outs = np.stack([out for _, out in pairs])
        assert np.isfinite(outs[:, :N]).all(), N
        assert np.isnan(outs[:, N:]).all(), N
