"""The recurrent seq2seq models the Transformer replaced: GRU, Bahdanau, Luong (global, local-p).

  GRUSeq2Seq         Cho et al. 2014: the decoder sees only the encoder's final state, the
                     "context vector", at every step (no attention).
  BahdanauSeq2Seq    Bahdanau et al. 2015: bidirectional GRU encoder, additive score
                     v^T tanh(W1 h_s + W2 s_{t-1}) from the previous decoder state, context
                     concatenated with the embedded decoder input (as the TensorFlow NMT
                     tutorial and bentrevett's pytorch-seq2seq do).
  LuongSeq2Seq       Luong et al. 2015, global attention with the dot / general / concat scores
                     of the current decoder state h_t, attentional state
                     h~_t = tanh(W_c [c_t; h_t]) and input feeding (h~_{t-1} joins the input).
  LuongLocalSeq2Seq  Luong local-p: predicted centre p_t = S_len * sigmoid(v_p^T tanh(W_p h_t)),
                     window [p_t - D, p_t + D], weights softmax-over-window * Gaussian.

Every attention score goes through `transformer_jax.attention.attend` (H = 1 head, T = 1 query:
the decoders run one step at a time).

Shape glossary (as in attention.py):
  B: batch   T: target length   S: source length   V: vocabulary
  E: embedding width   D: recurrent width   A: additive-attention width

All four models follow the translation-model protocol of decode.py: `__call__(src, tgt)`,
`init_decode_cache(src, max_len=)`, `decode_step(tokens, cache, index=)`. The decode cache is the
recurrent state plus the encoder memory; one step costs O(S), whatever the target length.

dtype: everything is float32. The GRU state is a scan carry that must keep one dtype from step to
step, and these models are small enough that bf16 would buy little.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
from flax import linen as nn

from transformer_jax.attention import attend

Array = jax.Array
Memory = dict[str, Array]  # encoder outputs a decoder attends to; every leaf [B, ...]
State = dict[str, Array]   # recurrent decoder state; every leaf [B, ...]

LuongScore = Literal["dot", "general", "concat"]


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
        return cls(src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size,
                   **{**cls._TINY, **overrides})


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
      src_vocab_size, tgt_vocab_size: vocabulary sizes (V).
      emb_dim: token embedding width (E), encoder and decoder.
      enc_hidden: GRU width of the encoder, per direction.
      dec_hidden: GRU width of the decoder (D); also Luong's attentional state width.
      attn_dim: width of the additive score (A); used by Bahdanau and Luong `concat`.
      bidirectional: bidirectional encoder (outputs 2 * enc_hidden wide).
      dropout: dropout on the embeddings (the tutorials' only dropout).
      luong_score: 'dot' (h_t . h_s), 'general' (h_t . W_a h_s) or 'concat'
        (v^T tanh(W_a [h_t; h_s])); Luong models only.
      local_window: D of Luong local-p: the window is [p_t - D, p_t + D] (paper: 10).
      pad_id, bos_id, eos_id: special token ids, shared by source and target.
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
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    _TINY: ClassVar[dict[str, Any]] = dict(
        emb_dim=16, enc_hidden=16, dec_hidden=16, attn_dim=16, dropout=0.0, local_window=2)

    def __post_init__(self):
        validate_common(self, ("src_vocab_size", "tgt_vocab_size", "emb_dim", "enc_hidden",
                               "dec_hidden", "attn_dim", "local_window"))
        if self.luong_score not in ("dot", "general", "concat"):
            raise ValueError(
                f"luong_score must be 'dot', 'general' or 'concat', got {self.luong_score!r}")
        if self.luong_score == "dot" and self.enc_out_dim != self.dec_hidden:
            raise ValueError(
                f"luong_score='dot' needs encoder outputs as wide as dec_hidden="
                f"{self.dec_hidden}, got {self.enc_out_dim} (enc_hidden={self.enc_hidden}, "
                f"bidirectional={self.bidirectional})")

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
    out, weights = attend(scores[:, None, None, :], values[:, :, None, :],
                          mask=mask[:, None, None, :])  # out [B, 1, 1, X], weights [B, 1, 1, S]
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
        self.w_keys = nn.Dense(a, use_bias=True)     # W1 (the bias of the joint layer lives here)
        self.w_query = nn.Dense(a, use_bias=False)   # W2
        self.v = nn.Dense(1, use_bias=False)

    def keys(self, values: Array) -> Array:
        return self.w_keys(values)  # [B, S, A]

    def __call__(self, query: Array, keys: Array) -> Array:
        energy = jnp.tanh(keys + self.w_query(query)[:, None, :])  # [B, S, A]
        return self.v(energy)[..., 0]                                # [B, S]


_LUONG_SCORES = {"dot": DotScore, "general": GeneralScore, "concat": AdditiveScore}


# ---------------------------------------------------------------------------------------------
# Encoder.


class GRUEncoder(nn.Module):
    """Embedding + one GRU layer (bidirectional if config says so), padding-aware.

    `seq_lengths` makes each direction stop (forward) or start (backward) at the sentence's last
    real token, so a sentence's outputs and final state do not depend on the batch's padding.
    """

    config: RNNSeq2SeqConfig

    @nn.compact
    def __call__(self, src: Array, *, deterministic: bool = True
                 ) -> tuple[Array, Array, Array]:
        """src [B, S] -> outputs [B, S, enc_out_dim] (0 at pads), final [B, enc_out_dim],
        mask [B, S] (True at real tokens)."""
        c = self.config
        mask = src != c.pad_id
        lengths = mask.sum(axis=-1)
        x = nn.Embed(c.src_vocab_size, c.emb_dim, name="embed")(src)  # [B, S, E]
        x = nn.Dropout(c.dropout)(x, deterministic=deterministic)
        if c.bidirectional:
            (fwd, bwd), outputs = nn.Bidirectional(
                nn.RNN(nn.GRUCell(c.enc_hidden, name="forward_cell")),
                nn.RNN(nn.GRUCell(c.enc_hidden, name="backward_cell")),
                name="rnn")(x, seq_lengths=lengths, return_carry=True)
            # fwd: state after the last real token; bwd: after reading back to the first.
            final = jnp.concatenate([fwd, bwd], axis=-1)
        else:
            final, outputs = nn.RNN(nn.GRUCell(c.enc_hidden, name="cell"), name="rnn")(
                x, seq_lengths=lengths, return_carry=True)
        # Past a sentence's end the RNNs keep running on pad embeddings; zero that junk.
        outputs = jnp.where(mask[..., None], outputs, 0.0)
        return outputs, final, mask


# ---------------------------------------------------------------------------------------------
# Decoder steps. Each is one time step: `prepare` turns encoder results into (memory, state0);
# `__call__(state, token, memory)` -> (state, logits [B, V], aux). `aux` holds the attention
# weights [B, S] (and Luong local's centre [B]) for `attention_maps`.


class _DecoderStep(nn.Module):
    """What every recurrent decoder step shares: embedding, GRU cell, output layer, bridge."""

    config: RNNSeq2SeqConfig

    def setup(self):
        c = self.config
        self.embed = nn.Embed(c.tgt_vocab_size, c.emb_dim)
        self.dropout = nn.Dropout(c.dropout)
        self.cell = nn.GRUCell(c.dec_hidden)
        self.out = nn.Dense(c.tgt_vocab_size)
        # The encoder's final state becomes the first decoder state: unchanged when the widths
        # already agree and it is one direction (Cho; Luong), else through tanh(W [fwd; bwd])
        # (Bahdanau's s_0, as in bentrevett's tutorial).
        if self.needs_bridge:
            self.bridge = nn.Dense(c.dec_hidden)

    @property
    def needs_bridge(self) -> bool:
        return self.config.bidirectional or self.config.enc_hidden != self.config.dec_hidden

    def initial_hidden(self, final: Array) -> Array:
        """[B, enc_out_dim] -> [B, D]."""
        return jnp.tanh(self.bridge(final)) if self.needs_bridge else final

    def embed_token(self, token: Array, deterministic: bool) -> Array:
        """[B] -> [B, E]."""
        return self.dropout(self.embed(token), deterministic=deterministic)

    def logits(self, features: Array) -> Array:
        return self.out(features).astype(jnp.float32)


class GRUDecoderStep(_DecoderStep):
    """Cho et al.: input [y_{t-1}; c], output from [y_{t-1}; s_t; c], c the context vector."""

    def prepare(self, outputs: Array, final: Array, mask: Array) -> tuple[Memory, State]:
        del outputs, mask  # no attention: the final state is all the decoder sees
        return {"context": final}, {"h": self.initial_hidden(final)}

    def __call__(self, state: State, token: Array, memory: Memory, *, deterministic: bool = True
                 ) -> tuple[State, Array, dict[str, Array]]:
        emb = self.embed_token(token, deterministic)                # [B, E]
        context = memory["context"]                                 # [B, enc_out_dim]
        h, _ = self.cell(state["h"], jnp.concatenate([emb, context], axis=-1))
        logits = self.logits(jnp.concatenate([emb, h, context], axis=-1))
        return {"h": h}, logits, {}


class BahdanauDecoderStep(_DecoderStep):
    """Bahdanau: attend with s_{t-1}; input [y_{t-1}; c_t]; output from [s_t; c_t; y_{t-1}]."""

    def setup(self):
        super().setup()
        self.score = AdditiveScore(self.config)

    def prepare(self, outputs: Array, final: Array, mask: Array) -> tuple[Memory, State]:
        memory = {"values": outputs, "keys": self.score.keys(outputs), "mask": mask}
        return memory, {"h": self.initial_hidden(final)}

    def __call__(self, state: State, token: Array, memory: Memory, *, deterministic: bool = True
                 ) -> tuple[State, Array, dict[str, Array]]:
        emb = self.embed_token(token, deterministic)
        scores = self.score(state["h"], memory["keys"])                          # [B, S]
        context, weights = _attend_one(scores, memory["values"], memory["mask"])  # [B, 2H]
        h, _ = self.cell(state["h"], jnp.concatenate([emb, context], axis=-1))
        logits = self.logits(jnp.concatenate([h, context, emb], axis=-1))
        return {"h": h}, logits, {"weights": weights}


class LuongDecoderStep(_DecoderStep):
    """Luong: h_t = GRU(h_{t-1}, [y_{t-1}; h~_{t-1}]) (input feeding), attend with h_t,
    h~_t = tanh(W_c [c_t; h_t]), logits = W_s h~_t.

    With `local=True`, local-p attention (eq. 9-10 of the paper): the softmax is restricted to
    the window |s - p_t| <= D and multiplied by exp(-(s - p_t)^2 / (2 sigma^2)), sigma = D / 2.
    """

    local: bool = False

    def setup(self):
        super().setup()
        c = self.config
        self.score = _LUONG_SCORES[c.luong_score](c)
        self.w_c = nn.Dense(c.dec_hidden, use_bias=False)
        if self.local:
            self.w_p = nn.Dense(c.dec_hidden, use_bias=False)
            self.v_p = nn.Dense(1, use_bias=False)

    def prepare(self, outputs: Array, final: Array, mask: Array) -> tuple[Memory, State]:
        memory = {"values": outputs, "keys": self.score.keys(outputs), "mask": mask}
        h0 = self.initial_hidden(final)
        return memory, {"h": h0, "feed": jnp.zeros_like(h0)}

    def __call__(self, state: State, token: Array, memory: Memory, *, deterministic: bool = True
                 ) -> tuple[State, Array, dict[str, Array]]:
        emb = self.embed_token(token, deterministic)
        h, _ = self.cell(state["h"], jnp.concatenate([emb, state["feed"]], axis=-1))
        scores = self.score(h, memory["keys"])                           # [B, S]
        if self.local:
            context, weights, aux = self._local_attention(h, scores, memory)
        else:
            context, weights = _attend_one(scores, memory["values"], memory["mask"])
            aux = {}
        attentional = jnp.tanh(self.w_c(jnp.concatenate([context, h], axis=-1)))  # h~_t [B, D]
        return ({"h": h, "feed": attentional}, self.logits(attentional),
                {"weights": weights, **aux})

    def _local_attention(self, h: Array, scores: Array, memory: Memory
                         ) -> tuple[Array, Array, dict[str, Array]]:
        d = self.config.local_window
        src_len = memory["mask"].sum(axis=-1).astype(jnp.float32)               # [B]
        centre = src_len * jax.nn.sigmoid(self.v_p(jnp.tanh(self.w_p(h)))[:, 0])  # p_t [B]
        positions = jnp.arange(scores.shape[-1], dtype=jnp.float32)              # s [S]
        offset = positions[None, :] - centre[:, None]                             # [B, S]
        window = jnp.logical_and(memory["mask"], jnp.abs(offset) <= d)
        gauss = jnp.exp(-(offset ** 2) / (2.0 * (d / 2.0) ** 2))                 # [B, S]
        # sum_s softmax_s * g_s * v_s: with one query per row the Gaussian can scale the values,
        # so the core's softmax-and-mix does the whole job.
        context, align = _attend_one(scores, memory["values"] * gauss[..., None], window)
        return context, align * gauss, {"centre": centre}


# ---------------------------------------------------------------------------------------------
# Models.


def _decoder_loop(step: nn.Module, carry, xs, memory: Memory, *, deterministic: bool,
                  free_running: bool):
    """Runs `step` over the target; xs = (tokens [T, B], use_target [T, B]) time-major."""

    def body(step, carry, xs, memory):
        state, prev_pred = carry
        target, use_target = xs
        token = jnp.where(use_target, target, prev_pred)
        state, logits, aux = step(state, token, memory, deterministic=deterministic)
        pred = jnp.argmax(logits, axis=-1).astype(target.dtype) if free_running else prev_pred
        return (state, pred), (logits, aux)

    scan = nn.scan(body, variable_broadcast="params", split_rngs={"params": False,
                                                                  "dropout": True},
                   in_axes=(0, nn.broadcast), out_axes=0)
    return scan(step, carry, xs, memory)


class _RNNSeq2Seq(nn.Module):
    """Encoder + one decoder step; subclasses pick the step. Implements the decode protocol."""

    config: RNNSeq2SeqConfig

    def setup(self):
        self.encoder = GRUEncoder(self.config)
        self.decoder = self.make_decoder()

    def make_decoder(self) -> nn.Module:
        raise NotImplementedError

    def encode(self, src: Array, *, deterministic: bool = True) -> tuple[Memory, State]:
        """src [B, S] -> (memory, first decoder state)."""
        outputs, final, mask = self.encoder(src, deterministic=deterministic)
        return self.decoder.prepare(outputs, final, mask)

    def logits_and_attention(self, src: Array, tgt: Array, *, deterministic: bool = True,
                             teacher_forcing: float = 1.0) -> tuple[Array, dict[str, Array]]:
        """`__call__`'s logits [B, T, V] and `attention_maps`' dict from one pass."""
        if not 0.0 <= teacher_forcing <= 1.0:
            raise ValueError(f"teacher_forcing must be in [0, 1], got {teacher_forcing}")
        memory, state = self.encode(src, deterministic=deterministic)
        tokens = tgt.T                                                    # [T, B], time-major
        free_running = teacher_forcing < 1.0
        if free_running:
            # One coin per step and sentence, from the 'sample' rng stream. Position 0 is BOS.
            use_target = jax.random.bernoulli(self.make_rng("sample"), teacher_forcing,
                                              tokens.shape)
            use_target = use_target.at[0].set(True)
        else:
            use_target = jnp.ones(tokens.shape, dtype=bool)
        _, (logits, aux) = _decoder_loop(
            self.decoder, (state, tokens[0]), (tokens, use_target), memory,
            deterministic=deterministic, free_running=free_running)
        aux = jax.tree_util.tree_map(lambda a: jnp.swapaxes(a, 0, 1), aux)  # [B, T, ...]
        return jnp.swapaxes(logits, 0, 1), aux

    def __call__(self, src: Array, tgt: Array, *, deterministic: bool = True,
                 teacher_forcing: float = 1.0) -> Array:
        """Teacher-forced logits.

        Args:
          src: [B, S] int32, padded with pad_id.
          tgt: [B, T] int32 decoder input, starting with BOS.
          deterministic: no dropout if True (else needs a 'dropout' rng).
          teacher_forcing: probability of feeding tgt[:, t] at step t; otherwise the model's
            own argmax from step t - 1 is fed. Below 1 it needs a 'sample' rng.
        Returns:
          logits [B, T, V] float32.
        """
        return self.logits_and_attention(src, tgt, deterministic=deterministic,
                                         teacher_forcing=teacher_forcing)[0]

    def attention_maps(self, src: Array, tgt: Array) -> dict[str, Array]:
        """Teacher-forced attention: {'weights': [B, T, S]} (+ Luong local's 'centre' [B, T]);
        {} for GRUSeq2Seq, which has none."""
        return self.logits_and_attention(src, tgt)[1]

    def init_decode_cache(self, src: Array, *, max_len: int) -> dict[str, Any]:
        """Encodes src once: {'state': decoder state, 'memory': encoder memory}, leaves [B, ...].

        max_len is unused: a recurrent state does not grow with the output.
        """
        del max_len
        memory, state = self.encode(src)
        return {"state": state, "memory": memory}

    def decode_step(self, tokens: Array, cache: dict[str, Any], *, index: Array
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
        return LuongDecoderStep(self.config, local=True)
