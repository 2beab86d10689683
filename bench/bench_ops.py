"""Times each Triton op at Qwen3-VL-8B shapes on CUDA against its torch reference and, for attention, against
torch's scaled_dot_product_attention on contiguous K/V. Prints one line per case as it goes, then a table.

    python bench/bench_ops.py [--quick] [--sweep-splits] [--json out.json]

Times are medians in microseconds (triton.testing.do_bench, which flushes L2 between runs; slow references
get a plain median of a few runs). Decode attention is timed as a replayed CUDA graph, as the engine runs it.
GB/s and TFLOP/s are computed from the minimum bytes/FLOPs each op must move (formulas in each case below),
for the Triton time; compare with the measured H200 ceilings of ~4.3 TB/s copy and ~785 TFLOP/s bf16 GEMM.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine.ops.activation import silu_and_mul_ref  # noqa: E402
from engine.ops.attention import AttentionMetadata, paged_attention_ref, varlen_attention_ref  # noqa: E402
from engine.ops.kv_cache import store_kvcache_ref  # noqa: E402
from engine.ops.norm import rms_norm_ref  # noqa: E402
from engine.ops.rotary import qk_norm_rope_ref, rope_and_store_kv_ref  # noqa: E402

HQ, HK, D, HIDDEN, INTER, BS = 32, 8, 128, 4096, 12288, 16   # Qwen3-VL-8B text model, block_size 16
VOCAB = 151936
V_HEADS, V_D = 16, 72                                        # its vision encoder
DT = torch.bfloat16
E = 2                                                        # bytes per bf16 element
DEV = "cuda"


def time_us(fn, graph: bool = False) -> float:
    """Median time of fn() in microseconds. graph=True captures one call in a CUDA graph and times replays."""
    fn()  # compile / warm up
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    if start.elapsed_time(end) > 20.0:  # a slow reference: a few plain runs are enough
        times = []
        for _ in range(3):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return 1e3 * statistics.median(times)
    from triton.testing import do_bench
    return 1e3 * do_bench(fn, warmup=10, rep=50, return_mode="median")


def ref_time_us(fn):
    """The reference's time, or None when it does not fit in memory at this shape."""
    try:
        return time_us(fn)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def paged_batch(decode_ctx: list[int], prefills: list[tuple[int, int]]):
    """Random caches behind shuffled block tables (blocks scattered as after churn), Qwen3-VL shapes."""
    seqs = [(1, c) for c in decode_ctx] + prefills
    nblocks = [-(-c // BS) for _, c in seqs]
    num_blocks = sum(nblocks)
    k_cache = torch.randn(num_blocks, BS, HK, D, device=DEV, dtype=DT)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device=DEV, dtype=torch.int32)
    bt = torch.zeros(len(seqs), max(nblocks), dtype=torch.int32, device=DEV)
    used = 0
    for i, n in enumerate(nblocks):
        bt[i, :n] = perm[used:used + n]
        used += n
    qsl = [0]
    for q_len, _ in seqs:
        qsl.append(qsl[-1] + q_len)
    lens = [c for _, c in seqs]
    md = AttentionMetadata(torch.zeros(qsl[-1], dtype=torch.int64, device=DEV),
                           torch.tensor(qsl, dtype=torch.int32, device=DEV),
                           torch.tensor(lens, dtype=torch.int32, device=DEV), bt, len(decode_ctx), len(decode_ctx),
                           max(q for q, _ in seqs), max(lens), qsl, lens)
    q = torch.randn(qsl[-1], HQ, D, device=DEV, dtype=DT)
    return q, k_cache, v_cache, md


def contiguous_kv(k_cache, v_cache, md):
    """Every sequence's K/V copied out of the cache as [B, Hk, ctx, D] for SDPA (equal lengths; not timed)."""
    ctx = md.seq_lens_cpu[0]
    blocks = md.block_tables[:, :-(-ctx // BS)].long()
    shape = (blocks.shape[0], -1, HK, D)
    k = k_cache[blocks].reshape(shape)[:, :ctx].transpose(1, 2).contiguous()
    v = v_cache[blocks].reshape(shape)[:, :ctx].transpose(1, 2).contiguous()
    return k, v


def sdpa(q, k, v, causal):
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except (TypeError, RuntimeError):  # older torch or no GQA kernel: repeat K/V (counts against SDPA)
        g = q.shape[-3] // k.shape[-3]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, -3), v.repeat_interleave(g, -3),
                                              is_causal=causal)


def decode_cases(quick: bool):
    from engine.ops.triton.attention import paged_attention
    scale = D ** -0.5
    for batch in (1, 64, 256):
        for ctx in ((512, 8192) if quick else (512, 2048, 8192)):
            q, kc, vc, md = paged_batch([ctx] * batch, [])
            # bytes: K and V of every context token (Hk*D each), plus q in and out; FLOPs: QK^T and PV
            nbytes = batch * ctx * HK * D * 2 * E + 2 * batch * HQ * D * E
            flops = 4 * batch * HQ * ctx * D
            t = time_us(lambda: paged_attention(q, kc, vc, md, scale), graph=True)
            ref = ref_time_us(lambda: paged_attention_ref(q, kc, vc, md, scale))
            # SDPA on contiguous [B, H, ctx, D] K/V (all sequences the same length, so this is fair)
            k, v = contiguous_kv(kc, vc, md)
            qs = q.view(batch, HQ, 1, D)
            sd = time_us(lambda: sdpa(qs, k, v, causal=False))
            yield f"decode attn B={batch} ctx={ctx}", t, nbytes, flops, ref, sd


def prefill_cases(quick: bool):
    from engine.ops.triton.attention import paged_attention
    scale = D ** -0.5
    shapes = [(512, 0), (8192, 0)] + ([] if quick else [(2048, 6144)])  # (new tokens, cached prefix)
    for n, prefix in shapes:
        q, kc, vc, md = paged_batch([], [(n, n + prefix)])
        # FLOPs: each query row i sees prefix + i + 1 keys (causal), 4*D per (q, k) pair per head
        flops = 4 * HQ * D * (n * prefix + n * (n + 1) // 2)
        nbytes = (n + prefix) * HK * D * 2 * E + 2 * n * HQ * D * E  # K/V once, q in, out
        t = time_us(lambda: paged_attention(q, kc, vc, md, scale))
        ref = ref_time_us(lambda: paged_attention_ref(q, kc, vc, md, scale))
        sd = None
        if prefix == 0:  # SDPA's is_causal is top-left aligned: equal to ours only without a prefix
            k, v = contiguous_kv(kc, vc, md)
            qs = q.transpose(0, 1).unsqueeze(0)
            sd = time_us(lambda: sdpa(qs, k, v, causal=True))
        yield f"prefill attn {n} tok" + (f" +{prefix} cached" if prefix else ""), t, nbytes, flops, ref, sd


def vision_cases(quick: bool):
    from engine.ops.triton.varlen_attention import varlen_attention
    for n in (1024, 4096):  # patches of one image (4096 = a 1024x1024 image)
        qkv = torch.randn(n, 3, V_HEADS, V_D, device=DEV, dtype=DT)
        q, k, v = qkv.unbind(1)
        cu = torch.tensor([0, n], dtype=torch.int32, device=DEV)
        flops = 4 * V_HEADS * V_D * n * n
        nbytes = 4 * n * V_HEADS * V_D * E
        t = time_us(lambda: varlen_attention(q, k, v, cu, n, V_D ** -0.5))
        ref = ref_time_us(lambda: varlen_attention_ref(q, k, v, cu, n, V_D ** -0.5))
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))
        sd = time_us(lambda: F.scaled_dot_product_attention(qs, ks, vs))
        yield f"vision attn {n} patches", t, nbytes, flops, ref, sd


def embedding_cases():
    """The token-embedding lookup from a table in page-locked host memory (--cpu-embeddings: the GPU reads the
    rows over PCIe) and from one in GPU memory; ref: torch's gather from the GPU table."""
    from engine.model.vocab_parallel_embedding import host_table
    from engine.ops.triton.embedding import embedding
    table = torch.randn(VOCAB, HIDDEN, device=DEV, dtype=DT)
    host = host_table(VOCAB, HIDDEN, DT)
    host.data.copy_(table)
    for t in (1, 256, 8192):
        ids = torch.randint(0, VOCAB, (t,), device=DEV)
        ref = time_us(lambda: F.embedding(ids, table))
        for where, weight in (("host", host), ("GPU", table)):   # read the rows, write them
            yield (f"embedding, {where} table T={t}", time_us(lambda: embedding(ids, weight, 0, VOCAB)),
                   2 * t * HIDDEN * E, 0, ref, None)


def elementwise_cases(quick: bool):
    from engine.ops.triton.activation import silu_and_mul
    from engine.ops.triton.kv_cache import store_kvcache
    from engine.ops.triton.norm import rms_norm
    from engine.ops.triton.rotary import qk_norm_rope, rope_and_store_kv
    yield from embedding_cases()
    for t in (1, 256, 8192):
        x = torch.randn(t, HIDDEN, device=DEV, dtype=DT)
        res = torch.randn_like(x)
        w = torch.rand(HIDDEN, device=DEV, dtype=DT) + 0.5
        # read x, residual; write normed, new residual (+ the weight once)
        yield (f"add+rms_norm T={t}", time_us(lambda: rms_norm(x, w, 1e-6, res)), 4 * t * HIDDEN * E + HIDDEN * E,
               0, time_us(lambda: rms_norm_ref(x, w, 1e-6, res)), None)

        gu = torch.randn(t, 2 * INTER, device=DEV, dtype=DT)
        yield (f"silu_and_mul T={t}", time_us(lambda: silu_and_mul(gu)), 3 * t * INTER * E, 0,
               time_us(lambda: silu_and_mul_ref(gu)), None)  # read gate and up, write one

        qkv = torch.randn(t, (HQ + 2 * HK) * D, device=DEV, dtype=DT)
        q = qkv[:, :HQ * D].view(t, HQ, D)
        k = qkv[:, HQ * D:(HQ + HK) * D].view(t, HK, D)
        v = qkv[:, (HQ + HK) * D:].view(t, HK, D)
        cos, sin = torch.randn(t, D // 2, device=DEV), torch.randn(t, D // 2, device=DEV)
        qw, kw = w[:D], w[D:2 * D]
        # read q and k, write them rotated, read fp32 cos and sin
        nbytes = 2 * t * (HQ + HK) * D * E + 2 * t * (D // 2) * 4
        yield (f"qk_norm_rope T={t}", time_us(lambda: qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)), nbytes, 0,
               time_us(lambda: qk_norm_rope_ref(q, k, qw, kw, 1e-6, cos, sin)), None)

        kc = torch.zeros(-(-t // BS) * 2, BS, HK, D, device=DEV, dtype=DT)
        vc = torch.zeros_like(kc)
        slots = torch.randperm(kc.shape[0] * BS, device=DEV)[:t]
        yield (f"store_kvcache T={t}", time_us(lambda: store_kvcache(k, v, kc, vc, slots)),
               4 * t * HK * D * E + 8 * t, 0, time_us(lambda: store_kvcache_ref(k, v, kc, vc, slots)), None)
        # the decoder's fused form of the two above: q rotated out, k rotated and v into the cache
        yield (f"rope_and_store_kv T={t}",
               time_us(lambda: rope_and_store_kv(q, k, v, cos, sin, kc, vc, slots, qw, kw, 1e-6)),
               nbytes + 2 * t * HK * D * E + 8 * t, 0,
               time_us(lambda: rope_and_store_kv_ref(q, k, v, cos, sin, kc, vc, slots, qw, kw, 1e-6)), None)


def sweep_splits():
    """Decode time against the split count, to tune attention.decode_num_splits on this GPU."""
    import engine.ops.triton.attention as attn
    chosen = attn.decode_num_splits
    print("\ndecode split sweep (us; * = the heuristic's choice)")
    for batch, ctx in ((1, 512), (1, 2048), (1, 8192), (8, 8192), (32, 4096), (64, 2048)):
        q, kc, vc, md = paged_batch([ctx] * batch, [])
        pick = chosen(batch, HK, md.block_tables.shape[1] * BS, q.device)
        row = []
        for s in (1, 2, 4, 8, 16, 32, 64):
            attn.decode_num_splits = lambda *a, s=s: s
            t = time_us(lambda: attn.paged_attention(q, kc, vc, md, D ** -0.5), graph=True)
            row.append(f"{s}:{t:.1f}{'*' if s == pick else ''}")
        attn.decode_num_splits = chosen
        print(f"  B={batch:<3} ctx={ctx:<5} " + "  ".join(row))


def sweep_attention_tiles():
    """Prefill (8192 causal tokens, paged) and vision (4096 patches, head 72) attention against the tile
    config (BLOCK_M, BLOCK_N, num_warps, num_stages), to tune attention.tile_config on this GPU."""
    import engine.ops.triton.attention as attn
    from engine.ops.triton.varlen_attention import varlen_attention
    chosen = attn.tile_config
    configs = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3),
               (128, 64, 4, 3), (64, 128, 4, 2), (128, 128, 8, 3)]
    q, kc, vc, md = paged_batch([], [(8192, 8192)])
    qkv = torch.randn(4096, 3, V_HEADS, V_D, device=DEV, dtype=DT)
    vq, vk, vv = (x.contiguous() for x in qkv.unbind(1))
    cu = torch.tensor([0, 4096], dtype=torch.int32, device=DEV)
    print("\nattention tile sweep (us; first = current choice)")
    for cfg in configs:
        attn.tile_config = lambda *a, cfg=cfg: cfg
        try:
            p = time_us(lambda: attn.paged_attention(q, kc, vc, md, D ** -0.5))
            v = time_us(lambda: varlen_attention(vq, vk, vv, cu, 4096, V_D ** -0.5))
            print(f"  {cfg}: prefill 8192 {p:8.1f}   vision 4096 {v:7.1f}", flush=True)
        except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory) is skipped
            print(f"  {cfg}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
    attn.tile_config = chosen


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--sweep-splits", action="store_true", help="also sweep the decode split count")
    ap.add_argument("--sweep-tiles", action="store_true", help="also sweep prefill/vision attention tiles")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--groups", default="decode,prefill,vision,elementwise",
                    help="comma-separated case groups to run")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_ops.py needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    rows = []
    groups = {"decode": decode_cases, "prefill": prefill_cases, "vision": vision_cases,
              "elementwise": elementwise_cases}
    for group in (groups[g] for g in args.groups.split(",")):
        for name, t, nbytes, flops, ref, sd in group(args.quick):
            row = {"op": name, "triton_us": t, "gb_s": nbytes / t / 1e3, "tflop_s": flops / t / 1e6,
                   "ref_us": ref, "sdpa_us": sd}
            rows.append(row)
            print(f"{name:<34} {t:9.1f} us" + (f"  ref {ref:10.1f} us" if ref else "  ref (out of memory)")
                  + (f"  sdpa {sd:8.1f} us" if sd else ""), flush=True)
    if args.sweep_splits:
        sweep_splits()
    if args.sweep_tiles:
        sweep_attention_tiles()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{'op':<34} {'triton us':>10} {'GB/s':>7} {'TFLOP/s':>8} {'x ref':>7} {'x sdpa':>7}")
    for r in rows:
        tflops = f"{r['tflop_s']:8.1f}" if r["tflop_s"] else f"{'-':>8}"
        vs_ref = f"{r['ref_us'] / r['triton_us']:7.1f}" if r["ref_us"] else f"{'-':>7}"
        vs_sdpa = f"{r['sdpa_us'] / r['triton_us']:7.2f}" if r["sdpa_us"] else f"{'-':>7}"
        print(f"{r['op']:<34} {r['triton_us']:10.1f} {r['gb_s']:7.0f} {tflops} {vs_ref} {vs_sdpa}")
    print("(x ref / x sdpa: how many times faster the Triton kernel is; decode timed as a CUDA graph replay)")


if __name__ == "__main__":
    main()
