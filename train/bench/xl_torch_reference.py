"""A compact PyTorch Transformer-XL (attn_type 0), written from the paper and the definitions of
the official code (kimiyoung/transformer-xl, pytorch/mem_transformer.py and
pytorch/utils/proj_adaptive_softmax.py): the reference of tests/test_xl_pytorch.py and the
PyTorch arm of the cpu_vs_torch section (`train.bench.cpu_vs_torch`).

It is time-major ([T, B, ...]) like the official model, and its module and parameter names are
the official ones (`layers.0.dec_attn.qkv_net.weight`, `crit.out_layers.0.bias`, ...), so its
`state_dict()` is what `xl_jax.load_pytorch_state_dict` reads. Differences from the official
code, none of which change a number:
  * the softmax returns the per-token NLL in token order (the official one groups tokens by
    cluster unless `keep_order`);
  * `rel_shift` is an explicit gather instead of the pad-and-view trick;
  * the memory starts as None instead of empty tensors;
  * `untie_r` puts u and v in each layer as `layers.{l}.dec_attn.r_w_bias` (the naming of the
    Hugging Face port; the official PyTorch code has shared biases only).
Eval-mode only matters for the tests (dropout is defined, but tests run `.eval()`).

torch is a test-only dependency: only the tests and the cpu_vs_torch section import this
module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rel_shift(x):
    """x [qlen, klen, ...] indexed by position row (distance klen-1-k) -> indexed by key:
    out[i, j] = x[i, j + qlen - 1 - i] for j <= i + klen - qlen, 0 above."""
    qlen, klen = x.shape[:2]
    i = torch.arange(qlen)[:, None]
    j = torch.arange(klen)[None, :]
    src = j + qlen - 1 - i
    ok = src < klen
    idx = torch.where(ok, src, torch.zeros_like(src))
    idx = idx.reshape(qlen, klen, *([1] * (x.dim() - 2))).expand_as(x)
    out = torch.gather(x, 1, idx)
    return out * ok.reshape(qlen, klen, *([1] * (x.dim() - 2))).to(x.dtype)


class RelPartialLearnableMultiHeadAttn(nn.Module):
    def __init__(self, n_head, d_model, d_head, dropout, dropatt, pre_lnorm, untie_r):
        super().__init__()
        self.n_head, self.d_head, self.pre_lnorm = n_head, d_head, pre_lnorm
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.dropatt = nn.Dropout(dropatt)
        if untie_r:
            self.r_w_bias = nn.Parameter(torch.zeros(n_head, d_head))
            self.r_r_bias = nn.Parameter(torch.zeros(n_head, d_head))

    def forward(self, w, r, r_w_bias, r_r_bias, attn_mask, mems):
        """w [qlen, B, D], r [klen, D] (distances klen-1 ... 0), attn_mask [qlen, klen] True =
        masked, mems [mlen, B, D] or None."""
        if r_w_bias is None:
            r_w_bias, r_r_bias = self.r_w_bias, self.r_r_bias
        qlen, bsz = w.shape[:2]
        cat = w if mems is None else torch.cat([mems, w], 0)
        if self.pre_lnorm:
            cat = self.layer_norm(cat)
        q, k, v = torch.chunk(self.qkv_net(cat), 3, dim=-1)
        klen = k.shape[0]
        q = q[-qlen:].view(qlen, bsz, self.n_head, self.d_head)
        k = k.view(klen, bsz, self.n_head, self.d_head)
        v = v.view(klen, bsz, self.n_head, self.d_head)
        rk = self.r_net(r).view(klen, self.n_head, self.d_head)
        ac = torch.einsum("ibnd,jbnd->ijbn", q + r_w_bias, k)  # (a) + (c)
        bd = rel_shift(torch.einsum("ibnd,jnd->ijbn", q + r_r_bias, rk))  # (b) + (d)
        score = (ac + bd) / self.d_head**0.5
        score = score.masked_fill(attn_mask[:, :, None, None], -float("inf"))
        prob = self.dropatt(F.softmax(score, dim=1))
        vec = torch.einsum("ijbn,jbnd->ibnd", prob, v).reshape(qlen, bsz, -1)
        out = self.drop(self.o_net(vec))
        return w + out if self.pre_lnorm else self.layer_norm(w + out)


class PositionwiseFF(nn.Module):
    def __init__(self, d_model, d_inner, dropout, pre_lnorm):
        super().__init__()
        self.pre_lnorm = pre_lnorm
        self.CoreNet = nn.Sequential(
            nn.Linear(d_model, d_inner),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(d_inner, d_model),
            nn.Dropout(dropout),
        )
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, x):
        if self.pre_lnorm:
            return x + self.CoreNet(self.layer_norm(x))
        return self.layer_norm(x + self.CoreNet(x))


class RelPartialLearnableDecoderLayer(nn.Module):
    def __init__(self, n_head, d_model, d_head, d_inner, dropout, dropatt, pre_lnorm, untie_r):
        super().__init__()
        self.dec_attn = RelPartialLearnableMultiHeadAttn(
            n_head, d_model, d_head, dropout, dropatt, pre_lnorm, untie_r
        )
        self.pos_ff = PositionwiseFF(d_model, d_inner, dropout, pre_lnorm)

    def forward(self, x, r, r_w_bias, r_r_bias, attn_mask, mems):
        return self.pos_ff(self.dec_attn(x, r, r_w_bias, r_r_bias, attn_mask, mems))


def _bounds(n_token, cutoffs):
    return [0] + list(cutoffs) + [n_token]


class AdaptiveEmbedding(nn.Module):
    def __init__(self, n_token, d_embed, d_proj, cutoffs, div_val):
        super().__init__()
        self.bounds, self.div_val, self.d_proj = _bounds(n_token, cutoffs), div_val, d_proj
        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ParameterList()
        if div_val == 1:
            self.emb_layers.append(nn.Embedding(n_token, d_embed))
            if d_proj != d_embed:
                self.emb_projs.append(nn.Parameter(torch.zeros(d_proj, d_embed)))
        else:
            for c in range(len(self.bounds) - 1):
                d_c = d_embed // div_val**c
                self.emb_layers.append(nn.Embedding(self.bounds[c + 1] - self.bounds[c], d_c))
                self.emb_projs.append(nn.Parameter(torch.zeros(d_proj, d_c)))

    def forward(self, tokens):
        if self.div_val == 1:
            out = self.emb_layers[0](tokens)
            if len(self.emb_projs):
                out = F.linear(out, self.emb_projs[0])
        else:
            out = torch.zeros(*tokens.shape, self.d_proj, dtype=self.emb_projs[0].dtype)
            for c in range(len(self.bounds) - 1):
                lo, hi = self.bounds[c], self.bounds[c + 1]
                inside = (tokens >= lo) & (tokens < hi)
                if inside.any():
                    out[inside] = F.linear(
                        self.emb_layers[c](tokens[inside] - lo), self.emb_projs[c]
                    )
        return out * self.d_proj**0.5


class ProjectedAdaptiveLogSoftmax(nn.Module):
    def __init__(self, n_token, d_embed, d_proj, cutoffs, div_val):
        super().__init__()
        self.bounds, self.div_val = _bounds(n_token, cutoffs), div_val
        self.n_clusters = len(cutoffs)
        if self.n_clusters:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters, d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters))
        self.out_layers = nn.ModuleList()
        self.out_projs = nn.ParameterList()
        n = len(self.bounds) - 1
        if div_val == 1:
            self.out_layers.append(nn.Linear(d_embed, n_token))
            self.out_projs.extend(
                [nn.Parameter(torch.zeros(d_proj, d_embed)) for _ in range(n)]
                if d_proj != d_embed
                else []
            )
        else:
            for c in range(n):
                d_c = d_embed // div_val**c
                self.out_layers.append(nn.Linear(d_c, self.bounds[c + 1] - self.bounds[c]))
                self.out_projs.append(nn.Parameter(torch.zeros(d_proj, d_c)))

    def _proj(self, c):
        return self.out_projs[c] if len(self.out_projs) else None

    def _cluster(self, c):
        if self.div_val == 1:
            lo, hi = self.bounds[c], self.bounds[c + 1]
            return self.out_layers[0].weight[lo:hi], self.out_layers[0].bias[lo:hi]
        return self.out_layers[c].weight, self.out_layers[c].bias

    @staticmethod
    def _logit(h, weight, bias, proj):
        if proj is not None:
            h = F.linear(h, proj.t())
        return F.linear(h, weight, bias)

    def forward(self, hidden, target):
        """hidden [N, d_proj], target [N] -> NLL [N] in token order."""
        if self.n_clusters == 0:
            w, b = self._cluster(0)
            lp = F.log_softmax(self._logit(hidden, w, b, self._proj(0)), -1)
            return -lp.gather(1, target[:, None])[:, 0]
        w, b = self._cluster(0)
        head = F.log_softmax(
            self._logit(
                hidden,
                torch.cat([w, self.cluster_weight]),
                torch.cat([b, self.cluster_bias]),
                self._proj(0),
            ),
            -1,
        )
        nll = torch.zeros_like(target, dtype=hidden.dtype)
        for c in range(self.n_clusters + 1):
            lo, hi = self.bounds[c], self.bounds[c + 1]
            inside = (target >= lo) & (target < hi)
            if not inside.any():
                continue
            t = target[inside] - lo
            if c == 0:
                lp = head[inside].gather(1, t[:, None])[:, 0]
            else:
                w, b = self._cluster(c)
                tail = F.log_softmax(self._logit(hidden[inside], w, b, self._proj(c)), -1)
                # Tail cluster c's probability sits in head column -c.
                lp = head[inside][:, -c] + tail.gather(1, t[:, None])[:, 0]
            nll[inside] = -lp
        return nll


class MemTransformerLM(nn.Module):
    def __init__(
        self,
        n_token,
        n_layer,
        n_head,
        d_model,
        d_head,
        d_inner,
        dropout=0.0,
        dropatt=0.0,
        tie_weight=True,
        d_embed=None,
        div_val=1,
        tie_projs=(),
        pre_lnorm=False,
        mem_len=0,
        cutoffs=(),
        same_length=False,
        clamp_len=-1,
        untie_r=False,
    ):
        super().__init__()
        d_embed = d_model if d_embed is None else d_embed
        self.d_model, self.mem_len = d_model, mem_len
        self.same_length, self.clamp_len = same_length, clamp_len
        self.word_emb = AdaptiveEmbedding(n_token, d_embed, d_model, cutoffs, div_val)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            [
                RelPartialLearnableDecoderLayer(
                    n_head, d_model, d_head, d_inner, dropout, dropatt, pre_lnorm, untie_r
                )
                for _ in range(n_layer)
            ]
        )
        self.crit = ProjectedAdaptiveLogSoftmax(n_token, d_embed, d_model, cutoffs, div_val)
        if tie_weight:
            for c in range(len(self.crit.out_layers)):
                self.crit.out_layers[c].weight = self.word_emb.emb_layers[c].weight
        for c, tie in enumerate(tie_projs):
            if tie and div_val == 1 and d_model != d_embed:
                self.crit.out_projs[c] = self.word_emb.emb_projs[0]
            elif tie and div_val != 1:
                self.crit.out_projs[c] = self.word_emb.emb_projs[c]
        if not untie_r:
            self.r_w_bias = nn.Parameter(torch.zeros(n_head, d_head))
            self.r_r_bias = nn.Parameter(torch.zeros(n_head, d_head))
        self.register_buffer(
            "inv_freq", 1 / (10000 ** (torch.arange(0.0, d_model, 2.0) / d_model)), persistent=False
        )

    def _mask(self, qlen, mlen):
        """[qlen, klen] bool, True = masked, as the official `_forward`."""
        klen = mlen + qlen
        ones = torch.ones(qlen, klen)
        masked = torch.triu(ones, diagonal=1 + mlen)
        if self.same_length:
            mask_len = klen - self.mem_len
            shift = qlen - mask_len if mask_len > 0 else qlen
            masked = masked + torch.tril(ones, -shift)
        return masked.bool()

    def forward(self, data, target, mems=None):
        """data, target [qlen, B]; mems: list of n_layer + 1 tensors [mlen, B, D] or None.
        Returns (nll [qlen, B], new mems)."""
        qlen, bsz = data.shape
        mlen = 0 if mems is None else mems[0].shape[0]
        klen = mlen + qlen
        x = self.drop(self.word_emb(data))
        dist = torch.arange(klen - 1, -1, -1.0, dtype=x.dtype)
        if self.clamp_len > 0:
            dist = dist.clamp(max=self.clamp_len)
        angles = torch.outer(dist, self.inv_freq.to(x.dtype))
        r = self.drop(torch.cat([angles.sin(), angles.cos()], -1))
        mask = self._mask(qlen, mlen)
        hids = [x]
        for i, layer in enumerate(self.layers):
            u = getattr(self, "r_w_bias", None)
            v = getattr(self, "r_r_bias", None)
            x = layer(x, r, u, v, mask, None if mems is None else mems[i])
            hids.append(x)
        x = self.drop(x)
        nll = self.crit(x.reshape(-1, x.shape[-1]), target.reshape(-1)).view(qlen, bsz)
        new_mems = None
        if self.mem_len > 0:
            with torch.no_grad():
                new_mems = [
                    (h if mems is None else torch.cat([m, h], 0))[-self.mem_len :].detach()
                    for h, m in zip(hids, mems or [None] * len(hids))
                ]
        return nll, new_mems


def from_config(cfg) -> MemTransformerLM:
    """The official model shaped as an `xl_jax.TransformerXLConfig` (dropout off); its
    parameters are the reference code's own initialisation."""
    return MemTransformerLM(
        n_token=cfg.vocab_size,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        d_model=cfg.d_model,
        d_head=cfg.d_head,
        d_inner=cfg.d_inner,
        tie_weight=cfg.tie_weights,
        d_embed=cfg.d_embed,
        div_val=cfg.div_val,
        tie_projs=cfg.tie_projs,
        pre_lnorm=cfg.norm_first,
        mem_len=cfg.mem_len,
        cutoffs=cfg.cutoffs,
        same_length=cfg.same_length,
        clamp_len=cfg.clamp_len,
        untie_r=cfg.untie_r,
    )
