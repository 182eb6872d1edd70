"""Numerical checks of the Transformer-XL against plain, term-by-term arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from model.cache import Positions
from model.config import TXLConfig
from model.transformer_xl import (
    MemTransformerLM,
    RelPartialLearnableMultiHeadAttn,
    attn_mask,
    relative_positions,
    segment_distances,
)


def tiny_config(**kw) -> TXLConfig:
    base = dict(n_layer=2, d_model=16, n_head=2, d_head=4, d_inner=32, dropout=0.0, tgt_len=6, mem_len=5)
    base.update(kw)
    return TXLConfig(**base)


def sinusoid(dist: int, d_model: int) -> torch.Tensor:
    inv = [1.0 / (10000 ** (2 * k / d_model)) for k in range(d_model // 2)]
    return torch.tensor([math.sin(dist * f) for f in inv] + [math.cos(dist * f) for f in inv], dtype=torch.float64)


def explicit_attention(attn, h, mems, u, v, clamp_len, window):
    """The paper's eq. for A_ij written out: (a) + (b) + (c) + (d), loops over i and j."""
    H, Dh = attn.n_head, attn.d_head
    W = attn.qkv_net.weight.double()
    Wq, Wk, Wv = W[: H * Dh], W[H * Dh : 2 * H * Dh], W[2 * H * Dh :]
    Wr, Wo = attn.r_net.weight.double(), attn.o_net.weight.double()
    u, v = u.double(), v.double()
    bsz, qlen, d = h.shape
    mlen = 0 if mems is None else mems.size(1)
    cat = h.double() if mems is None else torch.cat([mems, h], 1).double()
    out = torch.zeros(bsz, qlen, d, dtype=torch.float64)
    for b in range(bsz):
        for i in range(qlen):
            x_i = cat[b, mlen + i]
            heads = []
            for n in range(H):
                sl = slice(n * Dh, (n + 1) * Dh)
                q = Wq[sl] @ x_i
                scores, values = [], []
                for j in range(mlen + qlen):
                    dist = mlen + i - j
                    if dist < 0 or (window is not None and dist > window):
                        continue
                    rel = min(dist, clamp_len) if clamp_len > 0 else dist
                    k = Wk[sl] @ cat[b, j]
                    r = Wr[sl] @ sinusoid(rel, d)
                    a = q @ k  # (a) content-content
                    bb = q @ r  # (b) content-position
                    c = u[n] @ k  # (c) global content bias
                    dd = v[n] @ r  # (d) global position bias
                    scores.append((a + bb + c + dd) / math.sqrt(Dh))
                    values.append(Wv[sl] @ cat[b, j])
                p = torch.softmax(torch.stack(scores), 0)
                heads.append(sum(pj * vj for pj, vj in zip(p, values)))
            attn_out = Wo @ torch.cat(heads)
            out[b, i] = torch.nn.functional.layer_norm(
                h[b, i].double() + attn_out, (d,), attn.layer_norm.weight.double(), attn.layer_norm.bias.double())
    return out


@pytest.mark.parametrize("mlen", [0, 3])
@pytest.mark.parametrize("clamp_len", [0, 2])
@pytest.mark.parametrize("window", [None, 3])
def test_attention_equals_term_by_term(mlen, clamp_len, window):
    torch.manual_seed(0)
    cfg = tiny_config()
    attn = RelPartialLearnableMultiHeadAttn(cfg).eval()
    torch.nn.init.normal_(attn.layer_norm.weight, 1.0, 0.2)
    torch.nn.init.normal_(attn.layer_norm.bias, 0.0, 0.2)
    h = torch.randn(2, 4, cfg.d_model)
    mems = torch.randn(2, mlen, cfg.d_model) if mlen else None
    u, v = torch.randn(cfg.n_head, cfg.d_head), torch.randn(cfg.n_head, cfg.d_head)
    klen = mlen + 4

    def positions(clamp: int) -> Positions:
        r = MemTransformerLM(cfg).pos_emb(relative_positions(klen, clamp))  # rows: distances 0..klen-1
        assert r.shape == (klen, cfg.d_model)
        dist = segment_distances(4, mlen).clamp(min=0)[None, None]
        return Positions(dist, attn_mask(4, mlen, window)[None, None], r)

    got = attn(h, positions(clamp_len), u, v, mems)
    want = explicit_attention(attn, h, mems, u, v, clamp_len, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    if clamp_len and mlen:  # clamping must matter here, or the test proves nothing
        unclamped = attn(h, positions(0), u, v, mems)
        assert not torch.allclose(unclamped, got, atol=1e-4)


def test_no_gradient_flows_into_mems():
    torch.manual_seed(0)
    model = MemTransformerLM(tiny_config())
    x = torch.randint(0, 256, (2, 6))
    _, mems = model(x)
    assert mems is not None and not mems.requires_grad
    mems = mems.clone().requires_grad_(True)
    nll, new_mems = model.loss(x, x, mems)
    nll.mean().backward()
    assert mems.grad is None
    assert not new_mems.requires_grad
    assert model.word_emb.emb_layers[0].weight.grad is not None


def test_mems_keep_last_mem_len_layer_inputs():
    torch.manual_seed(0)
    cfg = tiny_config(mem_len=4)
    model = MemTransformerLM(cfg).eval()
    x = torch.randint(0, 256, (1, 6))
    _, mems = model(x)
    assert mems.shape == (cfg.n_layer, 1, 4, cfg.d_model)
    emb = model.word_emb(x)  # scaled by sqrt(d_model)
    torch.testing.assert_close(mems[0], emb[:, -4:])  # layer 0's input is the embedding


@pytest.mark.parametrize("seg", [1, 2, 5, 7, 40])
def test_same_length_segments_equal_token_by_token(seg):
    torch.manual_seed(0)
    cfg = tiny_config(mem_len=6, same_length=True, clamp_len=0)
    model = MemTransformerLM(cfg).eval()
    x = torch.randint(0, 256, (2, 41))
    inp, tgt = x[:, :-1], x[:, 1:]

    def run(step):
        mems, out = None, []
        for s in range(0, inp.size(1), step):
            nll, mems = model.loss(inp[:, s : s + step], tgt[:, s : s + step], mems)
            out.append(nll)
        return torch.cat(out, 1)

    with torch.no_grad():
        torch.testing.assert_close(run(seg), run(1), atol=1e-5, rtol=1e-5)


def test_without_same_length_segmentation_matters():
    """The control for the test above: with full attention to mems, splits change results."""
    torch.manual_seed(0)
    model = MemTransformerLM(tiny_config(mem_len=6, same_length=False)).eval()
    x = torch.randint(0, 256, (1, 21))
    with torch.no_grad():
        whole, _ = model.loss(x[:, :-1], x[:, 1:])
        mems, parts = None, []
        for s in range(0, 20, 1):
            nll, mems = model.loss(x[:, s : s + 1], x[:, s + 1 : s + 2], mems)
            parts.append(nll)
    assert not torch.allclose(whole, torch.cat(parts, 1), atol=1e-4)


def test_untie_r_and_pre_lnorm_variants_run_and_differ():
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 6))
    outs = []
    for untie_r, pre in [(True, False), (False, False), (True, True)]:
        torch.manual_seed(0)
        model = MemTransformerLM(tiny_config(untie_r=untie_r, pre_lnorm=pre)).eval()
        has_shared = hasattr(model, "r_w_bias")
        assert has_shared == (not untie_r)
        logits, _ = model(x)
        outs.append(logits)
    assert not torch.allclose(outs[0], outs[2])


def test_output_weights_tied_to_input_embedding():
    model = MemTransformerLM(tiny_config())
    assert model.crit.out_layers[0].weight.data_ptr() == model.word_emb.emb_layers[0].weight.data_ptr()


def test_config_validation():
    from txlserve.errors import ConfigError

    with pytest.raises(ConfigError, match="n_layer"):
        tiny_config(n_layer=0)
    with pytest.raises(ConfigError, match="dropout"):
        tiny_config(dropout=1.5)
    with pytest.raises(ConfigError, match="d_model"):
        tiny_config(d_model=15)
    with pytest.raises(ConfigError, match="unknown"):
        TXLConfig.from_dict({"n_layer": 2, "bogus": 1})
    cfg = tiny_config()
    assert TXLConfig.from_dict(cfg.to_dict()) == cfg
    without = {k: v for k, v in cfg.to_dict().items() if k not in ("n_head", "vocab_size")}
    with pytest.raises(ConfigError, match=r"no n_head, vocab_size \(the weights' shapes") as err:
        TXLConfig.from_dict(without)  # it was built with the default n_head, and loading called it a shape mismatch
    assert err.value.param == "n_head"
    short = {k: v for k, v in cfg.to_dict().items() if k != "dropout"}  # fields without a shape keep defaults
    assert TXLConfig.from_dict(short).dropout == TXLConfig.dropout
    for name in ("same_length", "pre_lnorm", "untie_r", "tie_weight"):  # a hand-edited "false" was read as true
        with pytest.raises(ConfigError, match=f"config.{name} must be true or false, got 'false'"):
            TXLConfig.from_dict({**cfg.to_dict(), name: "false"})


def test_hf_config_names_what_is_missing():
    from model.import_hf import hf_config
    from txlserve.errors import CheckpointError

    base = {"model_type": "transfo-xl", "n_layer": 2, "d_model": 32, "n_head": 2, "d_head": 16, "d_inner": 48,
            "vocab_size": 90, "cutoffs": [20, 50], "d_embed": 32, "div_val": 1, "mem_len": 7}
    assert hf_config(base).n_head == 2
    with pytest.raises(CheckpointError, match="has no model_type; txlserve imports Transformer-XL") as err:
        hf_config({k: v for k, v in base.items() if k != "model_type"})
    assert "None" not in str(err.value)  # it said "a None model"
    with pytest.raises(CheckpointError, match="is a 'gpt2' model, not a Transformer-XL"):
        hf_config({**base, "model_type": "gpt2"})
    with pytest.raises(CheckpointError, match="has no 'n_head'"):
        hf_config({k: v for k, v in base.items() if k != "n_head"})
    # keys a config leaves out are read as transformers reads them (TransfoXLConfig's defaults): same_length and
    # clamp_len were read as False and 0, a window one key wider than the reference's, and unclamped
    trimmed = hf_config({k: v for k, v in base.items() if k != "mem_len"})
    assert (trimmed.same_length, trimmed.clamp_len, trimmed.original_mem_len) == (True, 1000, 1600)
    assert hf_config({**base, "same_length": False, "clamp_len": 0}).original_mem_len == 7
    with pytest.raises(CheckpointError, match="config.json has a field of the wrong type"):
        hf_config({**base, "sample_softmax": None})
    for wrong in (5, "20,50"):  # named: a string was read as its characters
        with pytest.raises(CheckpointError, match="config.json's 'cutoffs' is .*, not a list of numbers"):
            hf_config({**base, "cutoffs": wrong})
    for wrong, says in (({"attn_type": 0, "clamp_len": "x"}, "config.json's 'clamp_len' is \"x\", not a number"),
                        ({"sample_softmax": "x"}, "'sample_softmax' is \"x\""), ({"n_head": True}, "'n_head' is true")):
        with pytest.raises(CheckpointError, match=says):  # named (found by a helper)
            hf_config({**base, **wrong})
    # flags are JSON's true and false: the string "false" was read as true, a model that computes otherwise
    for name in ("same_length", "pre_lnorm", "untie_r", "tie_word_embeddings", "proj_share_all_but_first"):
        for wrong in ("false", 0, None):
            with pytest.raises(CheckpointError, match=f"config.json's '{name}' is .*, not true or false"):
                hf_config({**base, name: wrong})
    with pytest.raises(CheckpointError, match="'tie_projs' is .*, not a list of true or false"):
        hf_config({**base, "tie_projs": [False, "true", 1]})
    flags = hf_config({**base, "same_length": False, "pre_lnorm": True, "tie_projs": [False, True, True]})
    assert (flags.same_length, flags.pre_lnorm, flags.tie_projs) == (False, True, (False, True, True))


def test_an_hf_vocabulary_that_is_not_utf8_is_one_line(tmp_path):
    from model.import_hf import read_vocab
    from txlserve.errors import CheckpointError

    (tmp_path / "vocab.txt").write_bytes("caf\xe9 1\nthe 2\n".encode("latin-1"))
    with pytest.raises(CheckpointError, match=r"vocab.txt cannot be read as UTF-8 text"):
        read_vocab(tmp_path)


def test_fp64_models_compute_in_fp64():
    """Scores follow the model's dtype: an fp64 attention matches the term-by-term sum to 1e-12, where an
    fp32 softmax would stop near 1e-7."""
    torch.manual_seed(0)
    cfg = tiny_config()
    attn = RelPartialLearnableMultiHeadAttn(cfg).double().eval()
    torch.nn.init.normal_(attn.layer_norm.weight, 1.0, 0.2)
    h, mems = torch.randn(2, 4, cfg.d_model, dtype=torch.float64), torch.randn(2, 3, cfg.d_model, dtype=torch.float64)
    u, v = torch.randn(cfg.n_head, cfg.d_head).double(), torch.randn(cfg.n_head, cfg.d_head).double()
    r = MemTransformerLM(cfg).double().pos_emb(relative_positions(7, 0))
    pos = Positions(segment_distances(4, 3).clamp(min=0)[None, None], attn_mask(4, 3, 3)[None, None], r)
    got = attn(h, pos, u, v, mems)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, explicit_attention(attn, h, mems, u, v, 0, 3), atol=1e-12, rtol=1e-12)


def test_dropout_acts_in_training_only_and_is_not_called_outside_it():
    """Outside training the model's dropouts hand back their input itself, without dispatching an op."""
    from model.transformer_xl import Dropout

    torch.manual_seed(0)
    model = MemTransformerLM(tiny_config(dropout=0.5, dropatt=0.5))
    assert sum(isinstance(m, Dropout) for m in model.modules()) == 2 * 4 + 1
    x = torch.randint(0, 256, (2, 6))  # [bsz, qlen]
    train = [model(x)[0] for _ in range(2)]
    assert not torch.equal(train[0], train[1])
    model.eval()
    with torch.profiler.profile() as prof:
        evals = [model(x)[0] for _ in range(2)]
    assert not [e for e in prof.events() if "dropout" in e.name]
    assert torch.equal(evals[0], evals[1])


@pytest.mark.parametrize("field, value, says", [
    ("clamp_len", 10**20, "config.clamp_len must be at most 1,099,511,627,776"),
    ("mem_len", 10**20, "config.mem_len must be at most 1,048,576")])
def test_a_config_past_torchs_positions_is_refused(field, value, says):
    """A checkpoint's clamp_len or mem_len of 10^20 was an OverflowError in eval, generate and serve (a helper)."""
    from txlserve.errors import ConfigError

    with pytest.raises(ConfigError, match=says):
        TXLConfig(**{field: value})
