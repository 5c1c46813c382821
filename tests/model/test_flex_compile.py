"""flex attention as training compiles it: one graph for every layer kind and layout (the kind is a
tensor, not a guarded constant), a recompile-limit hit raises instead of running unfused, and
the sm_12x / head_dim > 128 fallback. Compiled with a counting backend on the CPU: dynamo's
guards, which decide the graph count, are the same on CUDA; the graph runs flex's eager kernel."""

from __future__ import annotations

import pytest
import torch

from blockdraft.model import BlockLayout
from blockdraft.model import attention
from blockdraft.model.attention import LayerVisibility, anchor_block_attention, compiled_flex, flex_refusal
from blockdraft.train.anchors import sample_anchors
from blockdraft.train.step import positions_from_documents

KINDS = [LayerVisibility(None, False, "query"), LayerVisibility(None, True, "query"),
         LayerVisibility(6, False, "query"), LayerVisibility(6, True, "query"),
         LayerVisibility(6, False, "anchor"), LayerVisibility(6, True, "anchor")]


def layout(T: int, n: int, B: int, seed: int) -> BlockLayout:
    g = torch.Generator().manual_seed(seed)
    doc = torch.zeros(T, dtype=torch.long)
    doc[T // 3:] += 1
    doc[2 * T // 3:] += 1
    anchors = sample_anchors(doc, torch.ones(T, dtype=torch.long), B, n, g)
    return BlockLayout(doc, positions_from_documents(doc[None])[0], anchors, B)


def qkv(lay: BlockLayout, dtype=torch.float32, heads=4, kv=2, D=16):
    g = torch.Generator().manual_seed(1)
    N, B, T = lay.num_blocks, lay.block_size, lay.document_ids.shape[0]
    shapes = ((N, B, heads, D), (T, kv, D), (T, kv, D), (N, B, kv, D), (N, B, kv, D))
    return [torch.randn(*s, generator=g).to(dtype) for s in shapes]


def run_flex(fn, xs, lay, vis):
    """What attention._flex does, with `fn` as the compiled flex attention."""
    q, k_ctx, v_ctx, k_blk, v_blk = xs
    N, B, Hq, D = q.shape
    k = torch.cat([k_ctx, k_blk.reshape(N * B, -1, D)]).transpose(0, 1)[None]
    v = torch.cat([v_ctx, v_blk.reshape(N * B, -1, D)]).transpose(0, 1)[None]
    qf = q.reshape(N * B, Hq, D).transpose(0, 1)[None]
    out = fn(qf, k, v, block_mask=lay.block_mask(vis, q.device), scale=D ** -0.5, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(N, B, Hq, D)


def test_one_compiled_graph_serves_every_layer_kind_and_layout():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    fn = compiled_flex(counter)
    for T, n, seed in ((96, 6, 0), (160, 9, 1)):  # two layouts: other T, other N
        lay = layout(T, n, 4, seed)
        xs = qkv(lay)
        for vis in KINDS:
            got = run_flex(fn, xs, lay, vis)
            want = anchor_block_attention(*xs, lay, vis, scale=16 ** -0.5, backend="dense")
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # one graph; a second only if dynamo first compiles static shapes and then a dynamic one
    assert counter.frame_count <= 2, f"{counter.frame_count} graphs for {len(KINDS)} layer kinds"


def test_a_recompile_limit_hit_raises_instead_of_running_unfused():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    fn = compiled_flex(CompileCounter())
    lay = layout(96, 6, 4, 0)
    with torch._dynamo.config.patch(recompile_limit=1, cache_size_limit=1):
        run_flex(fn, qkv(lay), lay, KINDS[0])
        with pytest.raises(Exception, match="(?i)recompile|cache.?size|limit"):
            run_flex(fn, qkv(lay, torch.float64), lay, KINDS[0])  # another dtype: a new graph, over the limit


@pytest.mark.parametrize("cap,head_dim,refused", [((12, 0), 256, True), ((12, 0), 128, False),
                                                  ((9, 0), 256, False), ((12, 1), 192, True)])
def test_sm12x_with_wide_heads_falls_back_to_sdpa(monkeypatch, capsys, cap, head_dim, refused):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(attention, "_refusal_said", False)
    why = flex_refusal(torch.device("cuda", 0), head_dim)
    assert (why is not None) == refused
    assert flex_refusal(torch.device("cpu"), head_dim) is None
    # the auto backend takes the SDPA path, with one line said once
    assert attention._flex_refused(torch.device("cuda", 0), head_dim) == refused
    attention._flex_refused(torch.device("cuda", 0), head_dim)
    said = capsys.readouterr().out
    assert said.count("pytorch #198224") == (1 if refused else 0)
