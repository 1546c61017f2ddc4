"""Random translation models that decode like trained ones, for timing decoders without a run.

    config = opus_mt_config()                       # the size of an OPUS-MT (Marian) model
    params = random_params(config, seed=0)          # numpy float32, drawn as the init draws
    params = sharpen(config, params)                # decisive logits (see below)
    sources = random_sources(config, n=32, lengths=(8, 30), seed=0)
    params = calibrate_eos(config, params, sources[:8], max_len=48)   # outputs end, at lengths
    tokenizer = PiecesTokenizer(config)             # made-up pieces, for the exporters

Why sharpen: at their initial scale a random Transformer's logits are nearly uniform (for
58,101 tokens the best few differ by hundredths), so two engines whose float32 sums differ in
the last bits pick different tokens on near-ties, and EOS, one token among thousands, is
almost never chosen: every sentence runs to the length limit. And a deep random stack averages
its positions into one vector (its attention is near uniform), so the decoder's state hardly
depends on the step: it emits one token over and over (found on the OPUS-MT size: the same
token at every step, whatever token is fed back). `sharpen` therefore damps self-attention's
values (value and output kernels x `SELF_ATTENTION_GAIN`), makes cross-attention sharp (query
and key kernels x `CROSS_ATTENTION_SHARPNESS`, values x `CROSS_ATTENTION_GAIN`: each step
reads a part of the source, so outputs differ from source to source) and the FFNs strong
(kernels x `FFN_GAIN`: the token fed back is mapped to another, so outputs move on), and
multiplies the last LayerNorm's scale by `LOGIT_SCALE`, which scales the logits without
touching the embeddings the model reads (the output is tied to them). `calibrate_eos` then
adds a bias to the EOS logit (through that LayerNorm's bias, along the EOS embedding: every
config has that LayerNorm, not every config an output bias), chosen by bisection so that
greedy outputs are on average as long as their sources, as translations are: sentences end
at varied lengths, a few at the limit. The gains were chosen on the three models this serves
(a tiny test model, the cpu preset's, the OPUS-MT size) by the spread of output lengths and
how many outputs differ.

Nothing here changes a shape: the exporters (`save_ct2`, `save_marian`) take the params as
they take a trained model's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import TransformerConfig
from transformer_jax.decoding.decode import greedy_decode
from transformer_jax.model import Transformer

SELF_ATTENTION_GAIN = 0.3
CROSS_ATTENTION_SHARPNESS = 6.0
CROSS_ATTENTION_GAIN = 0.6
FFN_GAIN = 3.0
LOGIT_SCALE = 6.0
# Bisection steps of calibrate_eos over [0, _EOS_BIAS_MAX] (logit units): to within 1.
_EOS_STEPS = 6
_EOS_BIAS_MAX = 64.0


def opus_mt_config(**overrides: Any) -> TransformerConfig:
    """The Transformer of an OPUS-MT checkpoint (Helsinki-NLP/opus-mt-de-en's config.json, as
    `transformer_jax.interchange.marian.load_marian` builds it): 6+6 layers of 512, 8 heads,
    FFN 2048 with swish, post-LN with LayerNorm epsilon 1e-5, sines-then-cosines positions,
    embeddings scaled by sqrt(512), one table for source, target and output plus
    `final_logits_bias`, a vocabulary of 58,101 (EOS 0, <unk> 1, pad the last id), decoding
    from pad. 73,944,309 parameters; dropout off (it only decodes)."""
    fields = dict(
        src_vocab_size=58101,
        tgt_vocab_size=58101,
        d_model=512,
        n_heads=8,
        d_ff=2048,
        activation="swish",
        n_encoder_layers=6,
        n_decoder_layers=6,
        dropout=0.0,
        attention_dropout=0.0,
        norm_first=False,
        layer_norm_eps=1e-5,
        positional="sinusoidal_concat",
        max_len=512,
        scale_embeddings=True,
        share_embeddings=True,
        tie_output=True,
        output_bias=True,
        pad_id=58100,
        bos_id=58100,
        eos_id=0,
    )
    return TransformerConfig(**{**fields, **overrides})


def param_shapes(config: TransformerConfig) -> Any:
    """The 'params' tree of `Transformer(config)` as ShapeDtypeStructs (nothing allocated)."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens, tokens)["params"]


def random_params(config: TransformerConfig, *, seed: int = 0) -> dict:
    """Params of `Transformer(config)` drawn in NumPy at the initialisers' scales (no init to
    compile, which for 74M parameters takes longer than the draw): kernels [in, out] normal
    with Xavier's variance 2 / (in + out), embeddings (and learned positions) normal with std
    D ** -0.5, LayerNorm scales 1, biases 0. float32 NumPy arrays."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name, shape = path[-1].key, leaf.shape
        if name == "scale":
            return np.ones(shape, np.float32)
        if name in ("bias", "output_bias"):
            return np.zeros(shape, np.float32)
        std = (2.0 / (shape[0] + shape[-1])) ** 0.5 if name == "kernel" else config.d_model**-0.5
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    return jax.tree_util.tree_map_with_path(draw, param_shapes(config))


def _last_norm(config: TransformerConfig, params: Mapping) -> Mapping:
    """The LayerNorm whose output the logits read: the decoder's final norm (pre-LN) or its
    last layer's FFN residual norm (post-LN)."""
    decoder = params["decoder"]
    if config.norm_first:
        return decoder["final_norm"]
    return decoder[f"layers_{config.n_decoder_layers - 1}"]["ffn_residual"]["norm"]


def sharpen(config: TransformerConfig, params: Mapping) -> dict:
    """A copy of `params` with sharp attention, strong cross-attention and logits scaled by
    `LOGIT_SCALE` (the module docstring says why). Shapes unchanged; NumPy float32."""

    def scaled(path, x):
        name = "/".join(k.key for k in path)
        x = np.array(x, np.float32)
        if "cross_attn/" in name and name.endswith(("query/kernel", "key/kernel")):
            return x * np.float32(CROSS_ATTENTION_SHARPNESS)
        if "cross_attn/" in name and name.endswith(("value/kernel", "out/kernel")):
            return x * np.float32(CROSS_ATTENTION_GAIN)
        if "self_attn/" in name and name.endswith(("value/kernel", "out/kernel")):
            return x * np.float32(SELF_ATTENTION_GAIN)
        if "/ffn/" in name and name.endswith("kernel"):
            return x * np.float32(FFN_GAIN)
        return x

    out = jax.tree_util.tree_map_with_path(scaled, params)
    norm = _last_norm(config, out)
    norm["scale"] = norm["scale"] * np.float32(LOGIT_SCALE)
    return out


def with_eos_bias(config: TransformerConfig, params: Mapping, bias: float) -> dict:
    """A copy of `params` whose EOS logit is raised by `bias`: the last LayerNorm's bias gains
    bias * e / |e|^2 (e: EOS's output embedding), so its product with e is `bias`; other
    tokens' logits move by bias * cos(e, their row) * |row| / |e| (small, fixed noise)."""
    out = jax.tree.map(lambda x: np.array(x, np.float32), params)
    table = np.asarray(out["tgt_embed"]["embedding"])
    eos = table[config.eos_id]
    norm = _last_norm(config, out)
    norm["bias"] = norm["bias"] + np.float32(bias) * eos / np.float32(eos @ eos)
    return out


def output_lengths(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """[B, O] decoded ids -> [B] tokens up to and with the first EOS (O where none)."""
    tokens = np.asarray(tokens)
    ended = tokens == eos_id
    return np.where(ended.any(axis=1), ended.argmax(axis=1) + 1, tokens.shape[1])


def calibrate_eos(
    config: TransformerConfig,
    params: Mapping,
    src: np.ndarray,
    *,
    max_len: int,
    target: float | None = None,
) -> tuple[dict, dict[str, Any]]:
    """`with_eos_bias(params, b)` with b found by bisection such that the greedy outputs of
    `src` are on average `target` tokens long (EOS counted; an output without EOS counts
    max_len).

    Args:
      src: [B, S] source ids, pad-padded, each row ending with EOS.
      max_len: O, output positions of the greedy decode.
      target: mean output length to reach; default the sources' mean length (EOS counted).
    Returns:
      (params, {'eos_bias', 'target', 'mean_length'}); a bias of 0 when outputs are short
      enough already.
    """
    src = np.asarray(src, np.int32)
    if target is None:
        target = float(np.mean(np.sum(src != config.pad_id, axis=1)))
    model = Transformer(config.replace(dtype=jnp.float32))

    def mean_length(bias: float) -> float:
        tokens = greedy_decode(model, with_eos_bias(config, params, bias), src, max_len=max_len)
        return float(output_lengths(np.asarray(tokens), config.eos_id).mean())

    lo, hi, best = 0.0, _EOS_BIAS_MAX, (0.0, mean_length(0.0))
    if best[1] > target:
        for _ in range(_EOS_STEPS):
            mid = (lo + hi) / 2
            length = mean_length(mid)
            if abs(length - target) < abs(best[1] - target):
                best = (mid, length)
            lo, hi = (mid, hi) if length > target else (lo, mid)
    bias, length = best
    return with_eos_bias(config, params, bias), {
        "eos_bias": bias,
        "target": target,
        "mean_length": length,
    }


def random_sources(
    config: TransformerConfig, *, n: int, lengths: tuple[int, int], seed: int = 0
) -> list[list[int]]:
    """n source sentences of random ids (never pad, bos, eos or `PiecesTokenizer`'s <unk>),
    each of a length drawn uniformly from lengths = (min, max), EOS included at its end."""
    rng = np.random.default_rng(seed)
    banned = {config.pad_id, config.bos_id, config.eos_id, PiecesTokenizer(config).unk_id}
    words = np.array([i for i in range(config.src_vocab_size) if i not in banned], np.int32)
    low, high = lengths
    return [
        [*rng.choice(words, int(length) - 1).tolist(), config.eos_id]
        for length in rng.integers(low, high + 1, n)
    ]


class PiecesTokenizer:
    """Made-up pieces for a model's ids, as the exporters want a tokenizer: '<pad>', '</s>',
    '<s>' (unless bos is pad), '<unk>' at the lowest other id, '▁w{i}' for the rest. One joint
    vocabulary of the model's size (`save_ct2` reads `vocab_size` and `id_to_piece`). Needs
    src_vocab_size == tgt_vocab_size, as every shared-embedding model has."""

    def __init__(self, config: TransformerConfig):
        if config.src_vocab_size != config.tgt_vocab_size:
            raise ValueError(
                f"PiecesTokenizer makes one joint vocabulary; the model has "
                f"{config.src_vocab_size} source and {config.tgt_vocab_size} target ids"
            )
        self.vocab_size = config.tgt_vocab_size
        self.pad_id, self.bos_id, self.eos_id = config.pad_id, config.bos_id, config.eos_id
        special = {self.pad_id: "<pad>", self.eos_id: "</s>"}
        if self.bos_id != self.pad_id:
            special[self.bos_id] = "<s>"
        self.unk_id = next(i for i in range(self.vocab_size) if i not in special)
        special[self.unk_id] = "<unk>"
        self._special = special

    def id_to_piece(self, i: int) -> str:
        return self._special.get(int(i), f"▁w{int(i)}")


def describe(config: TransformerConfig, name: str = "") -> str:
    """'name: 6+6 x 512, 8 heads, FFN 2048, V 58,101, post-LN' (one line for a report)."""
    layout = "pre-LN" if config.norm_first else "post-LN"
    text = (
        f"{config.n_encoder_layers}+{config.n_decoder_layers} x {config.d_model}, "
        f"{config.n_heads} heads, FFN {config.d_ff}, V {config.tgt_vocab_size:,}, {layout}"
    )
    return f"{name}: {text}" if name else text


def source_batch(sources: Sequence[Sequence[int]], pad_id: int, length: int) -> np.ndarray:
    """[len(sources), length] int32, each row a source then pad."""
    out = np.full((len(sources), length), pad_id, np.int32)
    for row, s in enumerate(sources):
        out[row, : len(s)] = s
    return out
