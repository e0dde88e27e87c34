"""The C++ library's block products (chat/engine/kernels/blocks.cpp): every GGUF block type kept as the file has
it (nothing re-quantized), multiplied with 8-bit activations within rounding of the dense product, a row's
bits independent of its batch; the engine on them. Needs a C++ compiler (`make test` installs g++)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import ROOT
from test_native import FILES, library  # noqa: F401  (the library fixture)
from test_quant import blocks_of, int4_cpu, on_thread
from tinygguf import tiny_gguf

from chat.engine.kernels import cpu, gguf, quant
from chat.engine.model import weights

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
pytestmark = pytest.mark.usefixtures("library")  # built (or found) and loaded once
FORMS = {"Q4_0": "q4", "Q4_1": "q4", "Q4_K": "q4", "Q5_0": "q5", "Q5_1": "q5", "Q5_K": "q5", "Q8_0": "q8", "Q6_K": "q6"}


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [48, 45])  # 45: the last group of 8 rows padded
def test_the_blocks_keep_the_files_weights_bit_for_bit(kind, rows):
    tensor, reference = blocks_of(kind, rows=rows)
    matrix = on_thread(lambda: weights.blocks(tensor))
    assert matrix.form == FORMS[kind]
    assert np.array_equal(matrix.dense().numpy(), reference)
    # moved as stored (K-quants by the C++ library): the same as from the decoded parts
    decoded = on_thread(lambda: weights.blocks(tensor, stored=False))
    for a, b in ((matrix.qs, decoded.qs), (matrix.qh, decoded.qh), (matrix.scales, decoded.scales),
                 (matrix.dsuper, decoded.dsuper), (matrix.msuper, decoded.msuper)):
        assert (a is None and b is None) or torch.equal(a, b)
    assert torch.equal(matrix.mins.float(), decoded.mins.float()) and matrix.centre == decoded.centre
    assert (matrix.kind, matrix.sub, matrix.per_super) == (decoded.kind, decoded.sub, decoded.per_super)
    # 32-weight blocks keep the file's f16 scales: at most its size and a min a block; K-quants their byte scales
    # and f16 super-block scales (Q4_K/Q5_K: 12 bytes of 6-bit scales and mins a super-block unpacked to 16): at
    # most 3% more; Q6_K exactly its size
    padded = -(-rows // 8) * 8 / rows
    assert matrix.nbytes <= tensor.raw.nbytes * padded * {"Q6_K": 1.0}.get(kind, 1.12 if "K" not in kind else 1.03)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_byte_scales_multiply_as_their_float_scales(kind):
    """A K-quant's scales kept as the file's bytes times its f16 super-block scales (``Blocks.from_k``) give the
    products bit for bit that the same blocks with each scale multiplied out to float32 give (``from_parts``);
    Q6_K's 6-bit form (q in 0..63, its centre 32 taken off by each half's activation sum) within float rounding
    of the signed bytes' products."""
    tensor, _ = blocks_of(kind, rows=45, cols=512, seed=3)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)

    def products():
        kept = weights.blocks(tensor)
        parts = (*gguf.signed(tensor), None) if kind == "Q6_K" else gguf.affine(tensor)
        floats = quant.Blocks.from_parts(*parts, gguf.BITS.get(tensor.kind, 8))
        return kept, kept(x), floats(x), floats
    kept, ours, theirs, floats = on_thread(products)
    assert kept.per_super == 8 and kept.scales.dtype in (torch.uint8, torch.int8)
    assert floats.per_super == 0 and floats.scales.dtype == torch.float32  # d * sc is not exactly f16 here
    if kind == "Q6_K":
        assert kept.form == "q6" and floats.form == "q8"
        assert float((ours.float() - theirs.float()).norm() / theirs.float().norm()) < 2e-3  # bf16 outputs' ulps
    else:
        assert torch.equal(ours, theirs)
    assert kept.nbytes < floats.nbytes


@pytest.mark.parametrize("kind", TYPES)
def test_the_product_is_the_dense_product_and_each_row_its_own(kind):
    tensor, reference = blocks_of(kind, rows=80)

    def product():
        matrix = weights.blocks(tensor)
        x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        batch = matrix(x)
        alone = torch.cat([matrix(x[i:i + 1]) for i in range(9)])
        return batch, alone, x.float() @ torch.from_numpy(reference).T
    batch, alone, want = on_thread(product)
    assert torch.equal(batch, alone)  # 9 rows: two passes of four and one alone, each row as when alone
    # 8-bit activations (llama.cpp's Q8 dot products) and a bf16 output: within ~0.6 % of the dense product
    assert float((batch.float() - want).norm() / want.norm()) < 0.015


def test_q8_0_as_signed_bytes_is_the_same_product(monkeypatch):
    """Q8_0 runs as q + 128 with VNNI (``Blocks.U8``), as signed bytes with AVX2's sign trick elsewhere
    (``Blocks.S8``): both here, the same integer sums, so the same bits."""
    tensor, _ = blocks_of("Q8_0", rows=40)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out = {}
    for unsigned in (True, False):
        monkeypatch.setattr(quant, "_UNSIGNED", unsigned and bool(torch.ops.chat_native.blocks_vnni()))
        matrix = on_thread(lambda: weights.blocks(tensor))
        out[matrix.kind] = on_thread(lambda matrix=matrix: matrix(x))
    assert quant.Blocks.S8 in out
    assert all(torch.equal(y, out[quant.Blocks.S8]) for y in out.values())


PRODUCTS_ON_AVX2 = """
import sys, torch
from chat.engine.kernels import build, cpu
from chat.engine.model import weights
from test_blocks import TYPES
from test_native import SHARED, drain
from test_quant import blocks_of, on_thread
build.load(drain(build.build(SHARED, cpu.detect("avx2"))))
x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
torch.save({kind: on_thread(lambda: weights.blocks(blocks_of(kind, rows=80)[0])(x)) for kind in TYPES}, sys.argv[1])
"""


@pytest.mark.skipif(cpu.CLASSES.index(cpu.detect().machine) < cpu.CLASSES.index("avx2"), reason="no AVX2 here")
def test_the_avx2_build_multiplies_to_the_same_bits(tmp_path):
    """AVX2's maddubs (8-bit weights by the sign trick, widened at once) and this machine's build (VNNI where
    it has it) sum the same integers in the same order: every type's product is the same, bit for bit."""
    out = tmp_path / "avx2.pt"
    run = subprocess.run([sys.executable, "-c", PRODUCTS_ON_AVX2, str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
    assert run.returncode == 0, run.stderr[-3000:]
    avx2 = torch.load(out)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for kind in TYPES:
        here = on_thread(lambda kind=kind: weights.blocks(blocks_of(kind, rows=80)[0])(x))
        assert torch.equal(avx2[kind], here), kind


def test_bad_shapes_are_refused():
    tensor, _ = blocks_of("Q4_0")
    matrix = on_thread(lambda: weights.blocks(tensor))
    for bad in (torch.zeros(2, 128, dtype=torch.bfloat16), torch.zeros(2, 256), torch.zeros(256, dtype=torch.bfloat16)):
        with pytest.raises(RuntimeError):
            on_thread(lambda bad=bad: matrix(bad))


@int4_cpu
@pytest.mark.parametrize("file", list(FILES))
def test_a_decoder_on_blocks_answers_as_on_the_int4_kernel(file):
    f = gguf.read(tiny_gguf(**FILES[file]))

    def both():
        out = {}
        for name, blocks in (("int4", False), ("blocks", True)):
            decoder = weights.from_gguf(f, "int4", blocks=blocks)
            kv = decoder.cache(1, 16)
            kv.reserve(8)
            kv.mask[0, :8] = 1
            out[name] = (decoder, decoder.forward(torch.arange(3, 11)[None], kv, torch.arange(8)[None])[0, -1])
        return out
    out = on_thread(both)
    decoder, logits = out["blocks"]
    assert decoder.weights == "blocks" and on_thread(lambda: weights.verify(f, decoder))
    assert all(isinstance(p, (quant.Blocks, quant.Dense)) for lin in decoder.linears() for p in quant.parts(lin.quant))
    cosine = torch.nn.functional.cosine_similarity(logits, out["int4"][1], dim=0)
    assert cosine > 0.995 and logits.argmax() == out["int4"][1].argmax()


@pytest.mark.parametrize("head, hidden", [("Q5_0", 64), ("Q4_K", 256)])
def test_another_quantized_table_stays_the_files_blocks(head, hidden):
    """A token table in a block type the head's blocks cannot be looked up in (the real Qwen2.5-Coder Q4_K_M
    file's is Q5_0) is not kept de-quantized: the rows looked up are, each exactly as the dense table has it."""
    f = gguf.read(tiny_gguf(head=head, hidden=hidden))
    decoder = on_thread(lambda: weights.from_gguf(f, "int4", blocks=True))
    table = decoder.embed.table
    assert table is not None and decoder.embed.dense is None
    assert not isinstance(table.raw, np.memmap) and np.array_equal(table.raw, f.tensors["token_embd.weight"].raw)
    ids = torch.tensor([[0, 5], [77, 300]])
    want = gguf.dequantize(f.tensors["token_embd.weight"])[ids].to(torch.bfloat16)
    assert torch.equal(on_thread(lambda: decoder.embed(ids)), want)


@pytest.mark.parametrize("table", ["Q8_0", "Q6_K"])
def test_a_tied_8_bit_table_is_looked_up_in_the_heads_blocks(table):
    """A token table shared with the output layer in Q8_0 or Q6_K (Llama 3.2's, Qwen3's Q4_K_M files): lookups read
    the head's blocks, each row exactly as the file's weights dequantized, with no dense copy of the table."""
    f = gguf.read(tiny_gguf(hidden=256, head=table))
    decoder = on_thread(lambda: weights.from_gguf(f, "int4", blocks=True))
    assert decoder.embed.blocks is decoder.head.quant and decoder.embed.table is None and decoder.embed.dense is None
    ids = torch.tensor([0, 5, 77, 300, 13, 5])
    want = gguf.dequantize(f.tensors["token_embd.weight"])[ids].to(torch.bfloat16)
    assert torch.equal(on_thread(lambda: decoder.embed(ids)), want)
