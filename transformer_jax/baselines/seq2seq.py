r"""The recurrent seq2seq models the Transformer replaced: GRU/LSTM, Bahdanau, Luong, hard
attention.

`GRUSeq2Seq`
    Cho et al. 2014: the decoder sees only the encoder's final state, the "context vector",
    at every step (no attention). With `cell='lstm'` and `n_layers=2` it is Sutskever et al.
    2014 (bentrevett's tutorial 1) but for the context fed to every step.
`BahdanauSeq2Seq`
    Bahdanau et al. 2015: bidirectional GRU encoder, additive score
    :math:`v^\top \tanh(W_1 h_s + W_2 s_{t-1})` from the previous decoder state, context
    concatenated with the embedded decoder input (as the TensorFlow NMT tutorial and
    bentrevett's pytorch-seq2seq do).
`LuongSeq2Seq`
    Luong et al. 2015, global attention with the dot / general / concat scores of the current
    decoder state :math:`h_t`, attentional state :math:`\tilde h_t = \tanh(W_c [c_t; h_t])`
    and input feeding (:math:`\tilde h_{t-1}` joins the input).
`LuongLocalSeq2Seq`
    Luong local-p: predicted centre
    :math:`p_t = S \cdot \mathrm{sigmoid}(v_p^\top \tanh(W_p h_t))` (S the source length),
    window :math:`[p_t - D, p_t + D]`, weights softmax over the window times a Gaussian.
`LuongLocalMSeq2Seq`
    Luong local-m: monotonic centre :math:`p_t = t` (the decoder step), window
    :math:`[p_t - D, p_t + D]`, weights softmax over the window (no Gaussian).
`HardAttentionSeq2Seq`
    Stochastic "hard" attention (Xu et al. 2015, section 4.1) on Luong's decoder:
    :math:`a_t = \mathrm{softmax}(\mathrm{score})` is a distribution over source positions;
    in training one position :math:`s_t \sim a_t` is sampled and :math:`c_t = h_{s_t}`; at
    evaluation :math:`c_t = h_{\arg\max a_t}` (or, with `hard_inference='expectation'`, the
    soft context :math:`\sum_s a_t(s) h_s`). No gradient flows through the sample: the score
    is trained by REINFORCE, see `transformer_jax.losses.hard_attention_surrogate`.

Every attention weight goes through `transformer_jax.attention` (`attend` or
`attention_weights`; H = 1 head, T = 1 query: the decoders run one step at a time).

Every model takes `cell='gru'|'lstm'` and `n_layers` (encoder and decoder alike; dropout
`config.dropout` between layers); the defaults (one GRU layer) are the parameter trees these
models always had: layer 0's cell is `cell` (`forward_cell`/`backward_cell`), layer l > 0's
`cell_{l}`. Decoder layer l starts from encoder layer l's final state (bridged where the widths
or directions differ). An LSTM state is its (c, h) pair; attention and outputs read the top
layer's h.

Shapes (transformer_jax/shapes.py):
  B: batch   T: target length   S: source length   V: vocabulary
  E: embedding width   D: recurrent width   A: additive-attention width

All models follow the translation-model protocol of `transformer_jax.decoding.decode`:
`__call__(src, tgt)`, `init_decode_cache(src, max_len=)`, `decode_step(tokens, cache, index=)`,
and answer `attention_maps(src, tgt) -> {'cross': [B, 1, 1, T, S]}` ({} for GRUSeq2Seq). The
decode cache is the recurrent state plus the encoder memory; one step costs O(S), whatever the
target length.

dtype: everything is float32. The recurrent state is a scan carry that must keep one dtype from
step to step, and these models are small enough that bf16 would buy little.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
from flax import linen as nn

from transformer_jax.attention import attend, attention_weights

Array = jax.Array
Memory = dict[str, Array]  # encoder outputs a decoder attends to; every leaf [B, ...]
State = dict[str, Any]  # recurrent decoder state; every leaf [B, ...]
# One recurrent layer's state: h [B, D] for a GRU, (c, h) for an LSTM.
Carry = Array | tuple[Array, Array]

LuongScore = Literal["dot", "general", "concat"]
CELLS = ("gru", "lstm")
HARD_INFERENCE = ("argmax", "expectation")


class BaselinePresets:
    """`tutorial()` and `tiny()` for the baseline configs (here and in convs2s.py).

    The dataclass defaults are the tutorial sizes; `_TINY` holds the tiny ones.
    """

    _TINY: ClassVar[dict[str, Any]] = {}

    @classmethod
    def tutorial(cls, *, src_vocab_size: int, tgt_vocab_size: int, **overrides: Any):
        """The sizes of bentrevett's pytorch-seq2seq tutorials on Multi30k."""
        return cls(src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size, **overrides)

    @classmethod
    def tiny(cls, *, src_vocab_size: int = 32, tgt_vocab_size: int = 32, **overrides: Any):
        """A few thousand parameters and no dropout, for tests."""
        return cls(
            src_vocab_size=src_vocab_size,
            tgt_vocab_size=tgt_vocab_size,
            **{**cls._TINY, **overrides},
        )


def validate_common(config, positive: tuple[str, ...]) -> None:
    """Checks shared by the baseline configs: positive sizes, dropout, special ids."""
    for name in positive:
        value = getattr(config, name)
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not 0.0 <= config.dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {config.dropout!r}")
    ids = {"pad_id": config.pad_id, "bos_id": config.bos_id, "eos_id": config.eos_id}
    if len(set(ids.values())) != 3:
        raise ValueError(f"pad_id, bos_id and eos_id must differ, got {ids}")
    smallest = min(config.src_vocab_size, config.tgt_vocab_size)
    for name, value in ids.items():
        if not 0 <= value < smallest:
            raise ValueError(f"{name}={value} is outside the vocabularies (size {smallest})")


@dataclasses.dataclass(frozen=True)
class RNNSeq2SeqConfig(BaselinePresets):
    """Sizes of the recurrent baselines; defaults are the bentrevett Multi30k tutorial sizes.

    Attributes:
      src_vocab_size: the source vocabulary size (V).
      tgt_vocab_size: the target vocabulary size (V).
      emb_dim: token embedding width (E), encoder and decoder.
      enc_hidden: recurrent width of the encoder, per direction.
      dec_hidden: recurrent width of the decoder (D); also Luong's attentional state width.
      cell: 'gru' or 'lstm', the recurrent cell of encoder and decoder.
      n_layers: stacked recurrent layers, encoder and decoder each (dropout between them).
      attn_dim: width of the additive score (A); used by Bahdanau and Luong `concat`.
      bidirectional: bidirectional encoder (outputs 2 * enc_hidden wide).
      dropout: dropout on the embeddings and, with n_layers > 1, between recurrent layers.
      luong_score: 'dot' (:math:`h_t^\\top h_s`), 'general' (:math:`h_t^\\top W_a h_s`) or
        'concat' (:math:`v^\\top \\tanh(W_a [h_t; h_s])`); Luong models only.
      local_window: D of Luong local-p and local-m: the window is [p_t - D, p_t + D]
        (paper: 10).
      hard_inference: what hard attention attends to at evaluation: 'argmax' (the most
        probable source position, the same one-position context as in training) or
        'expectation' (the soft context sum_s a_t(s) h_s of Xu et al.'s deterministic view).
      pad_id: the padding id, shared by source and target.
      bos_id: the id decoding starts from.
      eos_id: the id that ends a sentence.
    """

    src_vocab_size: int
    tgt_vocab_size: int
    emb_dim: int = 256
    enc_hidden: int = 512
    dec_hidden: int = 512
    attn_dim: int = 512
    bidirectional: bool = True
    dropout: float = 0.5
    luong_score: LuongScore = "general"
    local_window: int = 10
    cell: Literal["gru", "lstm"] = "gru"
    n_layers: int = 1
    hard_inference: Literal["argmax", "expectation"] = "argmax"
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    _TINY: ClassVar[dict[str, Any]] = dict(
        emb_dim=16, enc_hidden=16, dec_hidden=16, attn_dim=16, dropout=0.0, local_window=2
    )

    def __post_init__(self):
        validate_common(
            self,
            (
                "src_vocab_size",
                "tgt_vocab_size",
                "emb_dim",
                "enc_hidden",
                "dec_hidden",
                "attn_dim",
                "local_window",
                "n_layers",
            ),
        )
        if self.cell not in CELLS:
            raise ValueError(f"cell must be one of {CELLS}, got {self.cell!r}")
        if self.hard_inference not in HARD_INFERENCE:
            raise ValueError(
                f"hard_inference must be one of {HARD_INFERENCE}, got {self.hard_inference!r}"
            )
        if self.luong_score not in ("dot", "general", "concat"):
            raise ValueError(
                f"luong_score must be 'dot', 'general' or 'concat', got {self.luong_score!r}"
            )
        if self.luong_score == "dot" and self.enc_out_dim != self.dec_hidden:
            raise ValueError(
                f"luong_score='dot' needs encoder outputs as wide as dec_hidden="
                f"{self.dec_hidden}, got {self.enc_out_dim} (enc_hidden={self.enc_hidden}, "
                f"bidirectional={self.bidirectional})"
            )

    @property
    def enc_out_dim(self) -> int:
        """Width of the encoder outputs and of its final state."""
        return self.enc_hidden * (2 if self.bidirectional else 1)


def _attend_one(scores: Array, values: Array, mask: Array) -> tuple[Array, Array]:
    """One query over S keys through the shared core.

    Args:
      scores: [B, S] float32 logits.
      values: [B, S, X].
      mask: [B, S] bool, True = attend.
    Returns:
      context [B, X], weights [B, S] (sum to 1 over the unmasked keys).
    """
    out, weights = attend(
        scores[:, None, None, :], values[:, :, None, :], mask=mask[:, None, None, :]
    )  # out [B, 1, 1, X], weights [B, 1, 1, S]
    return out[:, 0, 0], weights[:, 0, 0]


# ---------------------------------------------------------------------------------------------
# Attention scores. Each has `keys(values)`, the query-independent part computed once per source
# sentence, and `__call__(query, keys) -> [B, S]` computed once per decoder step.


class DotScore(nn.Module):
    """Luong `dot`: score(h_t, h_s) = h_t . h_s (needs enc_out_dim == dec_hidden)."""

    config: RNNSeq2SeqConfig

    def keys(self, values: Array) -> Array:
        return values  # [B, S, D]

    def __call__(self, query: Array, keys: Array) -> Array:
        return jnp.einsum("bd,bsd->bs", query, keys)


class GeneralScore(nn.Module):
    """Luong `general`: score(h_t, h_s) = h_t . W_a h_s; W_a h_s is computed once per source."""

    config: RNNSeq2SeqConfig

    def setup(self):
        self.w_a = nn.Dense(self.config.dec_hidden, use_bias=False)

    def keys(self, values: Array) -> Array:
        return self.w_a(values)  # [B, S, D]

    def __call__(self, query: Array, keys: Array) -> Array:
        return jnp.einsum("bd,bsd->bs", query, keys)


class AdditiveScore(nn.Module):
    """Bahdanau / Luong `concat`: score = v^T tanh(W1 h_s + W2 q).

    Luong's v_a^T tanh(W_a [h_t; h_s]) is the same function with W_a split into W2 and W1.
    """

    config: RNNSeq2SeqConfig

    def setup(self):
        a = self.config.attn_dim
        self.w_keys = nn.Dense(a, use_bias=True)  # W1 (the bias of the joint layer lives here)
        self.w_query = nn.Dense(a, use_bias=False)  # W2
        self.v = nn.Dense(1, use_bias=False)

    def keys(self, values: Array) -> Array:
        return self.w_keys(values)  # [B, S, A]

    def __call__(self, query: Array, keys: Array) -> Array:
        energy = jnp.tanh(keys + self.w_query(query)[:, None, :])  # [B, S, A]
        return self.v(energy)[..., 0]  # [B, S]


_LUONG_SCORES = {"dot": DotScore, "general": GeneralScore, "concat": AdditiveScore}


# ---------------------------------------------------------------------------------------------
# Recurrent layers.


def make_cell(config: RNNSeq2SeqConfig, features: int, name: str | None = None) -> nn.Module:
    """A GRU or LSTM cell (config.cell) of width `features`."""
    cell = nn.LSTMCell if config.cell == "lstm" else nn.GRUCell
    return cell(features, name=name)


def cell_output(carry: Carry) -> Array:
    """The h [B, D] of a GRU (h) or LSTM ((c, h)) state."""
    return carry[1] if isinstance(carry, tuple) else carry


def _layer_name(base: str, layer: int) -> str:
    """Layer 0 keeps the single-layer models' names (stable checkpoint paths)."""
    return base if layer == 0 else f"{base}_{layer}"


class RNNEncoder(nn.Module):
    """Embedding + `n_layers` GRU/LSTM layers (bidirectional if config says so), padding-aware.

    `seq_lengths` makes each direction stop (forward) or start (backward) at the sentence's last
    real token, so a sentence's outputs and final states do not depend on the batch's padding.
    """

    config: RNNSeq2SeqConfig

    @nn.compact
    def __call__(
        self, src: Array, *, deterministic: bool = True
    ) -> tuple[Array, tuple[Carry, ...], Array]:
        """src [B, S] -> outputs [B, S, enc_out_dim] of the top layer (0 at pads), the final
        state of each layer (leaves [B, enc_out_dim]; directions concatenated), mask [B, S]
        (True at real tokens)."""
        c = self.config
        mask = src != c.pad_id
        lengths = mask.sum(axis=-1)
        x = nn.Embed(c.src_vocab_size, c.emb_dim, name="embed")(src)  # [B, S, E]
        x = nn.Dropout(c.dropout)(x, deterministic=deterministic)
        finals = []
        for layer in range(c.n_layers):
            if layer:
                x = nn.Dropout(c.dropout)(x, deterministic=deterministic)
            if c.bidirectional:
                (fwd, bwd), x = nn.Bidirectional(
                    nn.RNN(make_cell(c, c.enc_hidden, _layer_name("forward_cell", layer))),
                    nn.RNN(make_cell(c, c.enc_hidden, _layer_name("backward_cell", layer))),
                    name=_layer_name("rnn", layer),
                )(x, seq_lengths=lengths, return_carry=True)
                # fwd: state after the last real token; bwd: after reading back to the first.
                final = jax.tree_util.tree_map(
                    lambda f, b: jnp.concatenate([f, b], axis=-1), fwd, bwd
                )
            else:
                final, x = nn.RNN(
                    make_cell(c, c.enc_hidden, _layer_name("cell", layer)),
                    name=_layer_name("rnn", layer),
                )(x, seq_lengths=lengths, return_carry=True)
            # Past a sentence's end the RNNs keep running on pad embeddings; zero that junk.
            x = jnp.where(mask[..., None], x, 0.0)
            finals.append(final)
        return x, tuple(finals), mask


# ---------------------------------------------------------------------------------------------
# Decoder steps. Each is one time step: `prepare` turns encoder results into (memory, state0);
# `__call__(state, token, memory)` -> (state, logits [B, V], aux). `aux` holds the attention
# weights [B, S] (and Luong local's centre [B]; hard attention's sampled position, its
# log-probability and the entropy of the weights) for `logits_and_attention`.


class _DecoderStep(nn.Module):
    """What every recurrent decoder step shares: embedding, cell stack, output layer, bridge."""

    config: RNNSeq2SeqConfig

    def setup(self):
        c = self.config
        self.embed = nn.Embed(c.tgt_vocab_size, c.emb_dim)
        self.dropout = nn.Dropout(c.dropout)
        self.out = nn.Dense(c.tgt_vocab_size)
        # Layer 0 is `cell` and `bridge` (the single-layer names); layer l, `cell_l`, `bridge_l`.
        for layer in range(c.n_layers):
            setattr(self, _layer_name("cell", layer), make_cell(c, c.dec_hidden))
        # The encoder's final state becomes the first decoder state: unchanged when the widths
        # already agree and it is one direction (Cho; Luong), else through tanh(W [fwd; bwd])
        # (Bahdanau's s_0, as in bentrevett's tutorial); an LSTM's c through its own W.
        if self.needs_bridge:
            for layer in range(c.n_layers):
                setattr(self, _layer_name("bridge", layer), nn.Dense(c.dec_hidden))
                if c.cell == "lstm":
                    setattr(self, _layer_name("bridge_c", layer), nn.Dense(c.dec_hidden))

    @property
    def needs_bridge(self) -> bool:
        return self.config.bidirectional or self.config.enc_hidden != self.config.dec_hidden

    def initial_state(self, finals: tuple[Carry, ...]) -> tuple[Carry, ...]:
        """The encoder's per-layer final states (leaves [B, enc_out_dim]) -> the decoder's
        (leaves [B, D])."""
        if not self.needs_bridge:
            return finals
        out = []
        for layer, final in enumerate(finals):
            bridge = getattr(self, _layer_name("bridge", layer))
            if isinstance(final, tuple):
                bridge_c = getattr(self, _layer_name("bridge_c", layer))
                out.append((jnp.tanh(bridge_c(final[0])), jnp.tanh(bridge(final[1]))))
            else:
                out.append(jnp.tanh(bridge(final)))
        return tuple(out)

    def run_cells(
        self, carries: tuple[Carry, ...], x: Array, deterministic: bool
    ) -> tuple[tuple[Carry, ...], Array]:
        """One step up the stack: input x [B, *] -> new per-layer states, top output h [B, D]."""
        new = []
        for layer, carry in enumerate(carries):
            if layer:
                x = self.dropout(x, deterministic=deterministic)
            carry, x = getattr(self, _layer_name("cell", layer))(carry, x)
            new.append(carry)
        return tuple(new), x

    def embed_token(self, token: Array, deterministic: bool) -> Array:
        """[B] -> [B, E]."""
        return self.dropout(self.embed(token), deterministic=deterministic)

    def logits(self, features: Array) -> Array:
        return self.out(features).astype(jnp.float32)


class GRUDecoderStep(_DecoderStep):
    """Cho et al.: input [y_{t-1}; c], output from [y_{t-1}; s_t; c], c the context vector
    (the top encoder layer's final h)."""

    def prepare(
        self, outputs: Array, finals: tuple[Carry, ...], mask: Array
    ) -> tuple[Memory, State]:
        del outputs, mask  # no attention: the final state is all the decoder sees
        return {"context": cell_output(finals[-1])}, {"layers": self.initial_state(finals)}

    def __call__(
        self, state: State, token: Array, memory: Memory, *, deterministic: bool = True
    ) -> tuple[State, Array, dict[str, Array]]:
        emb = self.embed_token(token, deterministic)  # [B, E]
        context = memory["context"]  # [B, enc_out_dim]
        layers, h = self.run_cells(
            state["layers"], jnp.concatenate([emb, context], axis=-1), deterministic
        )
        logits = self.logits(jnp.concatenate([emb, h, context], axis=-1))
        return {"layers": layers}, logits, {}


class BahdanauDecoderStep(_DecoderStep):
    """Bahdanau: attend with s_{t-1}; input [y_{t-1}; c_t]; output from [s_t; c_t; y_{t-1}]."""

    def setup(self):
        super().setup()
        self.score = AdditiveScore(self.config)

    def prepare(
        self, outputs: Array, finals: tuple[Carry, ...], mask: Array
    ) -> tuple[Memory, State]:
        memory = {"values": outputs, "keys": self.score.keys(outputs), "mask": mask}
        return memory, {"layers": self.initial_state(finals)}

    def __call__(
        self, state: State, token: Array, memory: Memory, *, deterministic: bool = True
    ) -> tuple[State, Array, dict[str, Array]]:
        emb = self.embed_token(token, deterministic)
        query = cell_output(state["layers"][-1])  # s_{t-1}
        scores = self.score(query, memory["keys"])  # [B, S]
        context, weights = _attend_one(scores, memory["values"], memory["mask"])  # [B, 2H]
        layers, h = self.run_cells(
            state["layers"], jnp.concatenate([emb, context], axis=-1), deterministic
        )
        logits = self.logits(jnp.concatenate([h, context, emb], axis=-1))
        return {"layers": layers}, logits, {"weights": weights}


def hard_attention_sample(rng: Array, scores: Array, mask: Array) -> tuple[Array, Array, Array]:
    """Draw one source position per row from a = softmax(scores) over the unmasked keys.

    Args:
      rng: PRNG key.
      scores: [B, S] float32 logits.
      mask: [B, S] bool, True = may be drawn (each row needs one).
    Returns:
      position [B] int32, log a(position) [B] (differentiable in `scores`: REINFORCE's
      score function), entropy of a [B] (differentiable).
    """
    log_a = jax.nn.log_softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)  # [B, S]
    position = jax.random.categorical(rng, log_a, axis=-1).astype(jnp.int32)
    log_prob = jnp.take_along_axis(log_a, position[:, None], axis=-1)[:, 0]
    # 0 * log 0 is 0: masked keys add nothing (and no NaN reaches the gradient).
    safe = jnp.where(mask, log_a, 0.0)
    entropy = -jnp.sum(jnp.exp(safe) * safe * mask, axis=-1)
    return position, log_prob, entropy


class LuongDecoderStep(_DecoderStep):
    """Luong: h_t = RNN(h_{t-1}, [y_{t-1}; h~_{t-1}]) (input feeding), attend with h_t,
    h~_t = tanh(W_c [c_t; h_t]), logits = W_s h~_t.

    `attention` picks how c_t is formed from the scores::

      'global'   softmax over every source position.
      'local_p'  eq. 9-10 of the paper: the softmax is restricted to the window |s - p_t| <= D
                 around a predicted centre p_t and multiplied by exp(-(s - p_t)^2 / (2 sigma^2)),
                 sigma = D / 2.
      'local_m'  the window around p_t = t, the decoder step, clamped to the last source token
                 (the paper's p_t = t leaves the window empty once t passes S_len + D); plain
                 softmax over the window.
      'hard'     one position drawn from the global softmax (argmax or expectation when
                 deterministic, per config.hard_inference); see `HardAttentionSeq2Seq`.
    """

    attention: Literal["global", "local_p", "local_m", "hard"] = "global"

    def setup(self):
        super().setup()
        c = self.config
        self.score = _LUONG_SCORES[c.luong_score](c)
        self.w_c = nn.Dense(c.dec_hidden, use_bias=False)
        if self.attention == "local_p":
            self.w_p = nn.Dense(c.dec_hidden, use_bias=False)
            self.v_p = nn.Dense(1, use_bias=False)

    def prepare(
        self, outputs: Array, finals: tuple[Carry, ...], mask: Array
    ) -> tuple[Memory, State]:
        memory = {"values": outputs, "keys": self.score.keys(outputs), "mask": mask}
        layers = self.initial_state(finals)
        feed = jnp.zeros_like(cell_output(layers[-1]))
        state = {"layers": layers, "feed": feed}
        if self.attention == "local_m":
            state["position"] = jnp.zeros(mask.shape[:1], jnp.int32)  # t [B]
        return memory, state

    def __call__(
        self, state: State, token: Array, memory: Memory, *, deterministic: bool = True
    ) -> tuple[State, Array, dict[str, Array]]:
        emb = self.embed_token(token, deterministic)
        layers, h = self.run_cells(
            state["layers"], jnp.concatenate([emb, state["feed"]], -1), deterministic
        )
        scores = self.score(h, memory["keys"])  # [B, S]
        new_state = {"layers": layers}
        if self.attention == "local_p":
            context, weights, aux = self._local_p(h, scores, memory)
        elif self.attention == "local_m":
            context, weights, aux = self._local_m(state["position"], scores, memory)
            new_state["position"] = state["position"] + 1
        elif self.attention == "hard":
            context, weights, aux = self._hard(scores, memory, deterministic)
        else:
            context, weights = _attend_one(scores, memory["values"], memory["mask"])
            aux = {}
        attentional = jnp.tanh(self.w_c(jnp.concatenate([context, h], axis=-1)))  # h~_t [B, D]
        new_state["feed"] = attentional
        return new_state, self.logits(attentional), {"weights": weights, **aux}

    def _local_p(
        self, h: Array, scores: Array, memory: Memory
    ) -> tuple[Array, Array, dict[str, Array]]:
        d = self.config.local_window
        src_len = memory["mask"].sum(axis=-1).astype(jnp.float32)  # [B]
        centre = src_len * jax.nn.sigmoid(self.v_p(jnp.tanh(self.w_p(h)))[:, 0])  # p_t [B]
        positions = jnp.arange(scores.shape[-1], dtype=jnp.float32)  # s [S]
        offset = positions[None, :] - centre[:, None]  # [B, S]
        window = jnp.logical_and(memory["mask"], jnp.abs(offset) <= d)
        gauss = jnp.exp(-(offset**2) / (2.0 * (d / 2.0) ** 2))  # [B, S]
        # sum_s softmax_s * g_s * v_s: with one query per row the Gaussian can scale the values,
        # so the core's softmax-and-mix does the whole job.
        context, align = _attend_one(scores, memory["values"] * gauss[..., None], window)
        return context, align * gauss, {"centre": centre}

    def _local_m(
        self, position: Array, scores: Array, memory: Memory
    ) -> tuple[Array, Array, dict[str, Array]]:
        last = memory["mask"].sum(axis=-1) - 1  # [B]
        centre = jnp.minimum(position, last).astype(jnp.float32)  # p_t [B]
        offset = jnp.arange(scores.shape[-1], dtype=jnp.float32)[None, :] - centre[:, None]
        window = jnp.logical_and(memory["mask"], jnp.abs(offset) <= self.config.local_window)
        context, weights = _attend_one(scores, memory["values"], window)
        return context, weights, {"centre": centre}

    def _hard(
        self, scores: Array, memory: Memory, deterministic: bool
    ) -> tuple[Array, Array, dict[str, Array]]:
        mask = memory["mask"]
        weights = attention_weights(scores[:, None, None, :], mask=mask[:, None, None, :])[
            :, 0, 0
        ]  # a_t [B, S]
        if not deterministic:
            position, log_prob, entropy = hard_attention_sample(
                self.make_rng("sample"), scores, mask
            )
        else:
            if self.config.hard_inference == "expectation":
                context = jnp.einsum("bs,bsx->bx", weights, memory["values"])
                return context, weights, {}
            position = jnp.argmax(weights, axis=-1).astype(jnp.int32)
            log_prob = entropy = jnp.zeros(scores.shape[:1], jnp.float32)
        # The sampled position's encoder output alone: no gradient reaches the score here.
        context = jnp.take_along_axis(memory["values"], position[:, None, None], axis=1)[:, 0]
        return context, weights, {"position": position, "log_prob": log_prob, "entropy": entropy}


# ---------------------------------------------------------------------------------------------
# Models.


def _decoder_loop(
    step: nn.Module, carry, xs, memory: Memory, *, deterministic: bool, free_running: bool
):
    """Runs `step` over the target; xs = (tokens [T, B], use_target [T, B]) time-major."""

    def body(step, carry, xs, memory):
        state, prev_pred = carry
        target, use_target = xs
        token = jnp.where(use_target, target, prev_pred)
        state, logits, aux = step(state, token, memory, deterministic=deterministic)
        pred = jnp.argmax(logits, axis=-1).astype(target.dtype) if free_running else prev_pred
        return (state, pred), (logits, aux)

    scan = nn.scan(
        body,
        variable_broadcast="params",
        split_rngs={"params": False, "dropout": True, "sample": True},
        in_axes=(0, nn.broadcast),
        out_axes=0,
    )
    return scan(step, carry, xs, memory)


class _RNNSeq2Seq(nn.Module):
    """Encoder + one decoder step; subclasses pick the step. Implements the decode protocol."""

    config: RNNSeq2SeqConfig

    def setup(self):
        self.encoder = RNNEncoder(self.config)
        self.decoder = self.make_decoder()

    def make_decoder(self) -> nn.Module:
        raise NotImplementedError

    def encode(self, src: Array, *, deterministic: bool = True) -> tuple[Memory, State]:
        """src [B, S] -> (memory, first decoder state)."""
        outputs, finals, mask = self.encoder(src, deterministic=deterministic)
        return self.decoder.prepare(outputs, finals, mask)

    def logits_and_attention(
        self, src: Array, tgt: Array, *, deterministic: bool = True, teacher_forcing: float = 1.0
    ) -> tuple[Array, dict[str, Array]]:
        """`__call__`'s logits [B, T, V] and the decoder's per-step aux, leaves [B, T, ...]:
        'weights' [B, T, S] (none for GRUSeq2Seq), Luong local's 'centre' [B, T], hard
        attention's 'position', 'log_prob' and 'entropy' [B, T] (the REINFORCE terms of
        `transformer_jax.losses.hard_attention_surrogate`)."""
        if isinstance(teacher_forcing, (int, float)):
            if not 0.0 <= teacher_forcing <= 1.0:
                raise ValueError(f"teacher_forcing must be in [0, 1], got {teacher_forcing}")
            free_running = teacher_forcing < 1.0
        else:  # a traced ratio (a schedule inside jit): coins whatever its value
            free_running = True
        memory, state = self.encode(src, deterministic=deterministic)
        tokens = tgt.T  # [T, B], time-major
        if free_running:
            # One coin per step and sentence, from the 'sample' rng stream. Position 0 is BOS.
            use_target = jax.random.bernoulli(
                self.make_rng("sample"), teacher_forcing, tokens.shape
            )
            use_target = use_target.at[0].set(True)
        else:
            use_target = jnp.ones(tokens.shape, dtype=bool)
        _, (logits, aux) = _decoder_loop(
            self.decoder,
            (state, tokens[0]),
            (tokens, use_target),
            memory,
            deterministic=deterministic,
            free_running=free_running,
        )
        aux = jax.tree_util.tree_map(lambda a: jnp.swapaxes(a, 0, 1), aux)  # [B, T, ...]
        return jnp.swapaxes(logits, 0, 1), aux

    def __call__(
        self, src: Array, tgt: Array, *, deterministic: bool = True, teacher_forcing: float = 1.0
    ) -> Array:
        """Teacher-forced logits.

        Args:
          src: [B, S] int32, padded with pad_id.
          tgt: [B, T] int32 decoder input, starting with BOS.
          deterministic: no dropout if True (else needs a 'dropout' rng).
          teacher_forcing: probability of feeding tgt[:, t] at step t; otherwise the model's
            own argmax from step t - 1 is fed. Below 1 it needs a 'sample' rng (as does hard
            attention when not deterministic: it samples its positions from that stream).
        Returns:
          logits [B, T, V] float32.
        """
        return self.logits_and_attention(
            src, tgt, deterministic=deterministic, teacher_forcing=teacher_forcing
        )[0]

    def attention_maps(self, src: Array, tgt: Array) -> dict[str, Array]:
        """The attention-map protocol: teacher-forced, deterministic
        {'cross': [B, 1, 1, T, S]} (one layer, one head); {} for GRUSeq2Seq, which has none.

        Rows sum to 1 except local-p's (softmax over the window times a Gaussian) and rows
        of pad queries."""
        aux = self.logits_and_attention(src, tgt)[1]
        return {"cross": aux["weights"][:, None, None]} if "weights" in aux else {}

    def init_decode_cache(self, src: Array, *, max_len: int) -> dict[str, Any]:
        """Encodes src once: {'state': decoder state, 'memory': encoder memory}, leaves [B, ...].

        max_len is unused: a recurrent state does not grow with the output.
        """
        del max_len
        memory, state = self.encode(src)
        return {"state": state, "memory": memory}

    def decode_step(
        self, tokens: Array, cache: dict[str, Any], *, index: Array
    ) -> tuple[Array, dict[str, Any]]:
        """tokens [B] (target position `index`) -> next-token logits [B, V] and the new cache."""
        del index  # the recurrent state already knows where it is
        state, logits, _ = self.decoder(cache["state"], tokens, cache["memory"])
        return logits, {"state": state, "memory": cache["memory"]}


class GRUSeq2Seq(_RNNSeq2Seq):
    """GRU encoder-decoder without attention (Cho et al. 2014)."""

    def make_decoder(self) -> nn.Module:
        return GRUDecoderStep(self.config)


class BahdanauSeq2Seq(_RNNSeq2Seq):
    """Additive attention over a (normally bidirectional) GRU encoder (Bahdanau et al. 2015)."""

    def make_decoder(self) -> nn.Module:
        return BahdanauDecoderStep(self.config)


class LuongSeq2Seq(_RNNSeq2Seq):
    """Luong global attention (config.luong_score) with input feeding."""

    def make_decoder(self) -> nn.Module:
        return LuongDecoderStep(self.config)


class LuongLocalSeq2Seq(_RNNSeq2Seq):
    """Luong local-p attention (window config.local_window around a predicted centre)."""

    def make_decoder(self) -> nn.Module:
        return LuongDecoderStep(self.config, attention="local_p")


class LuongLocalMSeq2Seq(_RNNSeq2Seq):
    """Luong local-m attention (window config.local_window around p_t = t)."""

    def make_decoder(self) -> nn.Module:
        return LuongDecoderStep(self.config, attention="local_m")


class HardAttentionSeq2Seq(_RNNSeq2Seq):
    """Stochastic hard attention on Luong's decoder (config.luong_score, input feeding).

    Training: `apply(..., deterministic=False, rngs={'sample': k, 'dropout': k2})` samples one
    source position per step. The logits alone train everything but the attention score (no
    gradient passes a sample); add `losses.hard_attention_surrogate` of the aux of
    `logits_and_attention` to the loss for REINFORCE. Evaluation (deterministic) attends to the
    argmax position, or the expectation (config.hard_inference).
    """

    def make_decoder(self) -> nn.Module:
        return LuongDecoderStep(self.config, attention="hard")
