"""An FA3-style FP8 attention forward for Hopper in Gluon (`triton.experimental.gluon`): a GPU-run candidate.

NOT VERIFIED NUMERICALLY. Gluon has no CPU interpreter, and no GPU was lent to the session that wrote
this: it is compiled for sm_90a on CPU (`GluonASTSource`, tests/ops/test_gluon_attention_compiles.py;
Triton 3.9 and, by hand on 2026-12-07, Triton 3.6, the GPU machine's: 168 registers at launch, no spills,
ptxas keeps its wgmmas asynchronous (no C7514 / C7512), the partitions' register budgets) and nothing more.
`attention.kernel: gluon` runs it (never chosen by `auto`: the measured table has no row for it);
benchmarks/attention_kernels.py's `gluon` cell measures its speed and its error against float64
attention on the GPU. Until that cell shows an error within the bar, treat its output as unknown.

Inputs are `triton_quant.prepare_qkv`'s (as the Triton kernel's): Q, K (B, H, S_pad, D) e4m3, V^T
(B, H, D, S_pad) e4m3, fp32 block scales; head dim 128 or 64, no mask, no LSE (the lowering keeps the
Triton kernel's reasons for those).

Structure (FlashAttention-3's, one CTA = 2 x 64 query rows of one (batch, head)):
* one producer warp (a worker partition) loads both Q tiles once, then K and V tiles of BLOCK_N keys
  through TMA into a ring of STAGES shared-memory buffers; `ready[s]` (TMA transaction bytes) tells the
  consumers a stage is full, `empty[s]` (two arrivals) tells the producer both consumers are done with it;
* two consumer warpgroups (the default partition and a 4-warp worker), each owning 64 query rows, run
  the same key loop on the shared ring: they ping-pong naturally, one's softmax (CUDA cores, MUFU) over
  the other's wgmmas (tensor cores); no named-barrier scheduling forces the alternation;
* per key tile, in a consumer: S = Q K^T as an async wgmma from shared memory, then the QK^T wgmma of
  the NEXT tile is issued before this tile's softmax (so the tensor cores work while exp2 runs); online
  softmax in fp32 base 2 as the Triton kernel (P against the running max, times p_scale, e4m3); P @ V
  as a wgmma with P in registers and a FRESH accumulator (use_acc=False) of BLOCK_N keys, added to the
  fp32 output accumulator on the CUDA cores (two-level accumulation: Hopper's FP8 wgmma keeps ~14 bits);
* one K and one V scale per key tile (BLOCK_N divides kv_block); the accumulator is kept in units of
  the current tile's V scale, as the Triton kernel does.
"""

from __future__ import annotations

import inspect
import math

import torch

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    GLUON_ERROR = None
except Exception as e:  # an old Triton, or none: the lowering reports this reason
    GLUON_ERROR = f"{type(e).__name__}: {e}"

LOG2E = 1.4426950408889634
#: query rows of one consumer warpgroup; a CTA holds two
BLOCK_M = 64
#: keys of one K / V tile: one QK^T wgmma (N) and one P @ V wgmma (K) with a fresh accumulator
BLOCK_N = 128
#: K / V tiles in flight in shared memory
STAGES = 2
#: register budgets of the partitions (setmaxnreg): consumers get the registers the producer gives up
CONSUMER_REGS, PRODUCER_REGS = 232, 40
HEAD_DIMS = (64, 128)


def gluon_reason() -> str | None:
    """None when this Triton has Gluon's Hopper API (Triton 3.6 and 3.9 do)."""
    return None if GLUON_ERROR is None else f"Gluon not importable ({GLUON_ERROR})"


def new_warp_specialize_api() -> bool:
    """Triton 3.9's gl.warp_specialize takes [(function, args), ...]; older Gluon (default_args,
    default_partition, worker_args, worker_partitions, ...)."""
    return "functions_and_args" in inspect.signature(gl.warp_specialize).parameters


if GLUON_ERROR is None:
    #: Triton 3.9 names the TMA load async_load (async_copy_global_to_shared is removed); 3.6 has only the latter.
    #: Bound here: the JIT of 3.6 resolves every attribute a kernel's source names, even in an untaken branch
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, q_row0, k_row0, v_row0, n_tiles):
        # tile sizes from the buffers: constexprs do not cross gl.warp_specialize's argument tuples
        BLOCK_M: gl.constexpr = q_smem.shape[1]
        BLOCK_N: gl.constexpr = k_smem.shape[1]
        STAGES: gl.constexpr = k_smem.shape[0]
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row0, 0], q_bar, q_smem.index(0))
        _tma_load(q_desc, [q_row0 + BLOCK_M, 0], q_bar, q_smem.index(1))
        for i in range(n_tiles):
            s = i % STAGES
            # a fresh barrier completes "phase -1": the first round's wait on parity 1 passes at once
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            _tma_load(k_desc, [k_row0 + i * BLOCK_N, 0], ready.index(s), k_smem.index(s))
            _tma_load(v_desc, [v_row0, i * BLOCK_N], ready.index(s), v_smem.index(s))

    @gluon.jit
    def _tile(
        s,
        s_next,
        i,
        acc,
        l_i,
        m_i,
        sv_cur,
        row_scale,
        offs_n,
        v_smem,
        empty,
        zero_o,
        sk_ptr,
        sv_ptr,
        bh,
        S_K,
        n_k,
        kv_block,
        log2_p,
        HAS_NEXT: gl.constexpr,
    ):
        """Key tile i's online softmax on its scores s, and its P @ V from a fresh accumulator added in fp32.
        With HAS_NEXT, s_next (the next tile's QK^T, in flight) is waited for with P @ V and returned finished:
        an accumulator still in flight must not cross the loop's back edge (its copies there read the wgmma's
        registers before the wait, and ptxas then serializes every wgmma: C7514)."""
        BLOCK_N: gl.constexpr = v_smem.shape[2]
        STAGES: gl.constexpr = v_smem.shape[0]
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=zero_o.type.layout, k_width=4)
        row_o: gl.constexpr = gl.SliceLayout(1, zero_o.type.layout)
        st = i % STAGES
        blk = gl.minimum((i * BLOCK_N) // kv_block, n_k - 1)
        sk = gl.load(sk_ptr + bh * n_k + blk)
        sv = gl.load(sv_ptr + bh * n_k + blk)
        c = row_scale * sk
        s = gl.where(gl.expand_dims(i * BLOCK_N + offs_n < S_K, 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * c)
        p = gl.exp2(s * gl.expand_dims(c, 1) - gl.expand_dims(m_new - log2_p, 1))  # P * p_scale
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        pq = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
        # a fresh accumulator for this tile's BLOCK_N keys, added in fp32 below (two-level accumulation)
        pv = warpgroup_mma(pq, v_smem.index(st).permute((1, 0)), zero_o, use_acc=False, is_async=True)
        if HAS_NEXT:
            pv, s_next = warpgroup_mma_wait(num_outstanding=0, deps=(pv, s_next))
        else:
            pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
        mbarrier.arrive(empty.index(st), count=1)
        rescale = gl.convert_layout(alpha * (sv_cur / sv), row_o)
        return acc * gl.expand_dims(rescale, 1) + pv, l_i, m_new, sv, s_next

    @gluon.jit
    def _consumer(
        WG: gl.constexpr,
        q_smem,
        k_smem,
        v_smem,
        q_bar,
        ready,
        empty,
        sq_ptr,
        sk_ptr,
        sv_ptr,
        out_ptr,
        bh,
        S_Q,
        S_K,
        n_q,
        n_k,
        q_block,
        kv_block,
        o_stride_b,
        o_stride_h,
        o_stride_s,
        H,
        pid_m,
        n_tiles,
        qk_scale,
        log2_p,
    ):
        BLOCK_M: gl.constexpr = q_smem.shape[1]
        D: gl.constexpr = q_smem.shape[2]
        BLOCK_N: gl.constexpr = k_smem.shape[1]
        STAGES: gl.constexpr = k_smem.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 32]
        )
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

        row0 = pid_m * (2 * BLOCK_M) + WG * BLOCK_M
        rows = row0 + gl.arange(0, BLOCK_M, layout=row_s)
        row_scale = gl.load(sq_ptr + bh * n_q + gl.minimum(rows // q_block, n_q - 1)) * qk_scale
        offs_n = gl.arange(0, BLOCK_N, layout=col_s)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        zero_o = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
        sv_cur = gl.load(sv_ptr + bh * n_k)

        mbarrier.wait(q_bar, 0)
        q = q_smem.index(WG)
        # QK^T of the first tile; in the loop, the next tile's is issued before this tile's softmax
        mbarrier.wait(ready.index(0), 0)
        s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        # every tile but the last: the next tile's QK^T goes out before this tile's softmax (the last tile
        # peeled off, so that no wgmma is issued under a condition)
        for i in range(n_tiles - 1):
            nst = (i + 1) % STAGES
            mbarrier.wait(ready.index(nst), ((i + 1) // STAGES) & 1)
            s_next = warpgroup_mma(q, k_smem.index(nst).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            acc, l_i, m_i, sv_cur, s = _tile(
                s,
                s_next,
                i,
                acc,
                l_i,
                m_i,
                sv_cur,
                row_scale,
                offs_n,
                v_smem,
                empty,
                zero_o,
                sk_ptr,
                sv_ptr,
                bh,
                S_K,
                n_k,
                kv_block,
                log2_p,
                True,
            )
        acc, l_i, m_i, sv_cur, s = _tile(
            s,
            s,
            n_tiles - 1,
            acc,
            l_i,
            m_i,
            sv_cur,
            row_scale,
            offs_n,
            v_smem,
            empty,
            zero_o,
            sk_ptr,
            sv_ptr,
            bh,
            S_K,
            n_k,
            kv_block,
            log2_p,
            False,
        )
        l_safe = gl.where(l_i > 0.0, l_i, 1.0)
        out = acc * gl.expand_dims(gl.convert_layout(sv_cur / l_safe, row_o), 1)
        b = bh // H
        h = bh % H
        o_rows = row0 + gl.arange(0, BLOCK_M, layout=row_o)
        o_cols = gl.arange(0, D, layout=col_o)
        ptrs = (
            out_ptr
            + b * o_stride_b
            + h * o_stride_h
            + gl.expand_dims(o_rows, 1) * o_stride_s
            + gl.expand_dims(o_cols, 0)
        )
        gl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(o_rows < S_Q, 1))

    @gluon.jit
    def _consumer_0(
        q_smem,
        k_smem,
        v_smem,
        q_bar,
        ready,
        empty,
        sq_ptr,
        sk_ptr,
        sv_ptr,
        out_ptr,
        bh,
        S_Q,
        S_K,
        n_q,
        n_k,
        q_block,
        kv_block,
        o_stride_b,
        o_stride_h,
        o_stride_s,
        H,
        pid_m,
        n_tiles,
        qk_scale,
        log2_p,
    ):
        _consumer(
            0,
            q_smem,
            k_smem,
            v_smem,
            q_bar,
            ready,
            empty,
            sq_ptr,
            sk_ptr,
            sv_ptr,
            out_ptr,
            bh,
            S_Q,
            S_K,
            n_q,
            n_k,
            q_block,
            kv_block,
            o_stride_b,
            o_stride_h,
            o_stride_s,
            H,
            pid_m,
            n_tiles,
            qk_scale,
            log2_p,
        )

    @gluon.jit
    def _consumer_1(
        q_smem,
        k_smem,
        v_smem,
        q_bar,
        ready,
        empty,
        sq_ptr,
        sk_ptr,
        sv_ptr,
        out_ptr,
        bh,
        S_Q,
        S_K,
        n_q,
        n_k,
        q_block,
        kv_block,
        o_stride_b,
        o_stride_h,
        o_stride_s,
        H,
        pid_m,
        n_tiles,
        qk_scale,
        log2_p,
    ):
        _consumer(
            1,
            q_smem,
            k_smem,
            v_smem,
            q_bar,
            ready,
            empty,
            sq_ptr,
            sk_ptr,
            sv_ptr,
            out_ptr,
            bh,
            S_Q,
            S_K,
            n_q,
            n_k,
            q_block,
            kv_block,
            o_stride_b,
            o_stride_h,
            o_stride_s,
            H,
            pid_m,
            n_tiles,
            qk_scale,
            log2_p,
        )

    @gluon.jit
    def _attn_fwd_kernel(
        q_desc,
        k_desc,
        v_desc,
        sq_ptr,
        sk_ptr,
        sv_ptr,
        out_ptr,
        H,
        S_Q,
        S_K,
        SQ_PAD,
        SK_PAD,
        n_q,
        n_k,
        q_block,
        kv_block,
        o_stride_b,
        o_stride_h,
        o_stride_s,
        qk_scale,
        log2_p,
        D: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        NEW_WS_API: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
    ):
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, D, BLOCK_N], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)  # both consumer warpgroups release a stage
        fence_async_shared()
        n_tiles = gl.cdiv(S_K, BLOCK_N)
        q_row0 = bh * SQ_PAD + pid_m * (2 * BLOCK_M)
        consumer_args = (
            q_smem,
            k_smem,
            v_smem,
            q_bar,
            ready,
            empty,
            sq_ptr,
            sk_ptr,
            sv_ptr,
            out_ptr,
            bh,
            S_Q,
            S_K,
            n_q,
            n_k,
            q_block,
            kv_block,
            o_stride_b,
            o_stride_h,
            o_stride_s,
            H,
            pid_m,
            n_tiles,
            qk_scale,
            log2_p,
        )
        producer_args = (
            q_desc,
            k_desc,
            v_desc,
            q_smem,
            k_smem,
            v_smem,
            q_bar,
            ready,
            empty,
            q_row0,
            bh * SK_PAD,
            bh * D,
            n_tiles,
        )
        if NEW_WS_API:
            gl.warp_specialize(
                [(_consumer_0, consumer_args), (_consumer_1, consumer_args), (_producer, producer_args)],
                [4, 1],
                [CONSUMER_REGS, PRODUCER_REGS],
            )
        else:
            gl.warp_specialize(
                consumer_args,
                _consumer_0,
                [consumer_args, producer_args],
                [_consumer_1, _producer],
                [4, 1],
                [CONSUMER_REGS, PRODUCER_REGS],
            )


def shared_layouts(d: int):
    """NVMMA shared layouts of the Q, K and V^T tiles (128-byte swizzle, fp8)."""
    q = gl.NVMMASharedLayout.get_default_for([BLOCK_M, d], gl.float8e4nv)
    k = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], gl.float8e4nv)
    v = gl.NVMMASharedLayout.get_default_for([d, BLOCK_N], gl.float8e4nv)
    return q, k, v


def attention_reason(head_dim: int, *, masked: bool, need_lse: bool) -> str | None:
    """None when the Gluon kernel can run this node (Gluon present, head dim 64 / 128, no mask, no LSE)."""
    reason = gluon_reason()
    if reason:
        return reason
    if head_dim not in HEAD_DIMS:
        return f"the Gluon FP8 attention kernel takes head dims {HEAD_DIMS}, got {head_dim}"
    if masked:
        return "the Gluon FP8 attention kernel takes no mask (attention.kernel triton does)"
    if need_lse:
        return "the Gluon FP8 attention kernel returns no log-sum-exp (attention.kernel triton does)"
    return None


def fp8_flash_attention(
    qq,
    sq,
    kq,
    sk,
    vt,
    sv,
    *,
    s_q: int,
    s_k: int,
    softmax_scale: float,
    q_block: int,
    kv_block: int,
    p_scale: float = 448.0,
    out_dtype=torch.bfloat16,
) -> torch.Tensor:
    """The Gluon kernel on `triton_quant.prepare_qkv`'s outputs (FP8 P, no mask, no LSE): (B, H, s_q, D)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, h, sq_pad, d = qq.shape
    sk_pad = kq.shape[2]
    reason = attention_reason(d, masked=False, need_lse=False)
    if reason:
        raise ValueError(reason)
    n_q, n_k = sq.shape[-1], sk.shape[-1]
    kb = kv_block if n_k > 1 else sk_pad
    if kb % BLOCK_N:
        raise ValueError(f"the Gluon kernel's key tile {BLOCK_N} must divide kv_block={kb}")
    qb = q_block if n_q > 1 else sq_pad
    sq, sk, sv = (t.float().expand(b, h, t.shape[-1]).contiguous() for t in (sq, sk, sv))
    out = torch.empty((b, h, s_q, d), dtype=out_dtype, device=qq.device)
    ql, kl, vl = shared_layouts(d)
    q_desc = TensorDescriptor.from_tensor(qq.reshape(b * h * sq_pad, d), [BLOCK_M, d], ql)
    k_desc = TensorDescriptor.from_tensor(kq.reshape(b * h * sk_pad, d), [BLOCK_N, d], kl)
    v_desc = TensorDescriptor.from_tensor(vt.reshape(b * h * d, sk_pad), [d, BLOCK_N], vl)
    grid = (triton.cdiv(s_q, 2 * BLOCK_M), b * h)
    if b * h and s_q:
        _attn_fwd_kernel[grid](
            q_desc,
            k_desc,
            v_desc,
            sq,
            sk,
            sv,
            out,
            h,
            s_q,
            s_k,
            sq_pad,
            sk_pad,
            n_q,
            n_k,
            qb,
            kb,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            softmax_scale * LOG2E,
            math.log2(p_scale),
            D=d,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            STAGES=STAGES,
            NEW_WS_API=new_warp_specialize_api(),
            CONSUMER_REGS=CONSUMER_REGS,
            PRODUCER_REGS=PRODUCER_REGS,
            num_warps=4,
        )
    return out
