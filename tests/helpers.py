"""Helpers shared by several test modules: one home, so no test imports another test's names.

The PyTorch, transformers and SentencePiece imports are lazy, inside the helpers that need
them: they are optional test dependencies, and a module that never calls those helpers must
still import this one without them.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import os
import queue
import signal
import subprocess
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

from train.core.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def subprocess_xla_flags() -> str:
    """The test run's XLA flags (conftest.py) without its 8 fake devices: what a run a test
    starts as a subprocess gets (its devices are its own: JAX_NUM_CPU_DEVICES or one)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join(f for f in flags if not f.startswith("--xla_force_host_platform_device_count"))


# The fused cuDNN kernel needs a GPU; under tests/conftest.py that takes
# JAX_PLATFORMS=cuda,cpu (the default is the 8 fake CPU devices).
needs_gpu = pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="the fused cuDNN kernel needs a GPU"
)


# ---------------------------------------------------------------------------- tiny runs
def toy_loss(params, batch, *, rng, extra, deterministic):
    """The loop tests' toy regression: squared error of x @ w + b against y, with a random
    per-row keep mask from the step rng (like dropout), so exact resume needs the step rng."""
    err = (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2  # [B]
    if not deterministic:
        err = err * jax.random.bernoulli(rng, 0.75, err.shape)
    return err.sum(), {"n_tokens": jnp.float32(err.shape[0])}, extra


# A fresh tiny LM command line, with a fixed cosine horizon (decay_steps), so runs given
# different --steps follow the same trajectory and their metrics compare exactly; progress:
# a line per log interval (stderr is no terminal).
FRESH_LM = [
    "--preset",
    "tiny",
    "--decay_steps",
    "20",
    "--eval_tokens",
    "300",
    "--plots",
    "false",
    "--progress",
    "true",
]


def tiny_lm_config(data_dir, dataset="ptb", **overrides):
    """The tiny Transformer-XL run the LM tests share (6 steps, a checkpoint every 3, a fixed
    horizon, so a shorter or resumed run follows the same trajectory)."""
    from train import lm  # lazy: helpers is imported by tests that never train

    fields = dict(
        steps=6,
        decay_steps=6,
        learning_rate=0.05,
        log_every=1,
        checkpoint_every=3,
        eval_tokens=600,
        plots=False,
        progress=False,
        data_dir=str(data_dir),
    )
    return lm.config_for_data(dataset, "tiny", **{**fields, **overrides})


# ---------------------------------------------------------------------------- parallel text

MADE_UP_WORDS = [f"w{i}" for i in range(40)]


def write_lines(path, lines, *, gz=False) -> str:
    """`lines` as a UTF-8 text file (gzipped with gz), one a line -> its path."""
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    with gzip.open(path, "wb") if gz else open(path, "wb") as f:
        f.write(data)
    return str(path)


def made_up_corpus(n, seed):
    """Sentences of a made-up language and their 'translations' (the words reversed and
    upper-cased): learnable, and enough text for a small SentencePiece vocabulary."""
    rng = np.random.default_rng(seed)
    src = [" ".join(rng.choice(MADE_UP_WORDS, rng.integers(3, 9))) for _ in range(n)]
    return src, [" ".join(w.upper() for w in reversed(s.split())) for s in src]


# ---------------------------------------------------------------------------- batches
def epoch_batches(batcher, epoch: int):
    """The `num_batches` batches of a `TokenBatcher`'s `epoch`, in training order (built
    lazily), read from its epoch plan rather than from `iterate`, which tests compare with."""
    for L, rows in batcher._epoch_plan(epoch):
        yield batcher._gather(L, rows)


# ---------------------------------------------------------------------------- work directories


def train_losses(workdir) -> list[tuple[int, float]]:
    """(step, loss) of every train record in a work directory's metrics.jsonl."""
    return [(r["step"], r["loss"]) for r in read_metrics(str(workdir)) if r["split"] == "train"]


def mtimes(directory) -> dict[str, int]:
    """{name: modification time in ns} of the entries of `directory`: unchanged when nothing
    was written there again."""
    return {
        name: os.stat(os.path.join(directory, name)).st_mtime_ns for name in os.listdir(directory)
    }


def tree_of(directory) -> dict[str, bytes | None]:
    """{path relative to `directory`: a file's bytes, or None for a directory} of everything
    below it: equal before and after when nothing there was added, removed or changed."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            if name in dirs:
                out[os.path.relpath(path, directory)] = None
            else:
                with open(path, "rb") as f:
                    out[os.path.relpath(path, directory)] = f.read()
    return out


def file_hashes(directory) -> dict[str, str]:
    """{path relative to `directory`: sha256} of every file below it."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), directory)] = hashlib.sha256(
                    f.read()
                ).hexdigest()
    return out


# ---------------------------------------------------------------------------- compute dtypes


def matmul_sites(fn, *args) -> list[tuple[str, str, str, str]]:
    """(where, lhs, rhs, result dtype names) of every dot_general in the program fn(*args)
    traces, scans, custom VJPs and nested jits included; `where` is the product's name stack
    (Flax module path, then the einsum spec or module name, under `transpose(...)` or
    `rematted_computation` in a backward pass): which dtype each product really multiplies in."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(
                    (
                        str(eqn.source_info.name_stack),
                        *(str(v.aval.dtype) for v in (*eqn.invars, eqn.outvars[0])),
                    )
                )
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else (param,):
                    if isinstance(sub, jax_core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax_core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def matmul_dtypes(fn, *args) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) dtype names of every dot_general in the program fn(*args) traces
    (`matmul_sites` without the names): which dtype a model really multiplies in."""
    return [site[1:] for site in matmul_sites(fn, *args)]


# ---------------------------------------------------------------------------- NumPy references


def np_dense(x, p):
    return x @ np.asarray(p["kernel"], np.float64) + np.asarray(p["bias"], np.float64)


def np_multi_head_attention(xq, xkv, p, mask, n_heads):
    """The obvious way: project, then per example and head softmax(q k^T / sqrt(K)) v.

    xq [B, T, D], xkv [B, S, D], mask broadcastable to [B, 1, T, S]; head h is columns
    h*K .. (h+1)*K of the projections.
    """
    q, k, v = (np_dense(x, p[name]) for x, name in ((xq, "query"), (xkv, "key"), (xkv, "value")))
    b_, t_, d = q.shape
    hk = d // n_heads
    mask = np.broadcast_to(mask, (b_, 1, t_, xkv.shape[1]))
    out = np.zeros_like(q)
    for b in range(b_):
        for h in range(n_heads):
            cols = slice(h * hk, (h + 1) * hk)
            scores = q[b, :, cols] @ k[b, :, cols].T / np.sqrt(hk)
            scores = np.where(mask[b, 0], scores, -np.inf)
            w = np.exp(scores - scores.max(-1, keepdims=True))
            out[b, :, cols] = (w / w.sum(-1, keepdims=True)) @ v[b, :, cols]
    return np_dense(out, p["out"])


def _np_layer_norm(x, p, eps=1e-6):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * np.asarray(p["scale"]) + np.asarray(p["bias"])


def _np_sublayer(x, p_norm, fn, norm_first, eps=1e-6):
    if norm_first:
        return x + fn(_np_layer_norm(x, p_norm, eps))
    return _np_layer_norm(x + fn(x), p_norm, eps)


_NP_ACTIVATIONS = {
    "relu": lambda x: np.maximum(x, 0.0),
    "swish": lambda x: x / (1 + np.exp(-x)),
    "gelu": lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2.0))),
}


def _np_ffn(x, p, activation="relu"):
    return np_dense(_NP_ACTIVATIONS[activation](np_dense(x, p["inner"])), p["outer"])


def _np_positions(length, d, layout="interleaved"):
    pe = np.zeros((length, d))
    for pos in range(length):
        for i in range(d // 2):
            sin_at, cos_at = (i, d // 2 + i) if layout == "concat" else (2 * i, 2 * i + 1)
            pe[pos, sin_at] = np.sin(pos / 10000 ** (2 * i / d))
            pe[pos, cos_at] = np.cos(pos / 10000 ** (2 * i / d))
    return pe


def np_transformer(params, cfg, src, tgt):
    """Section 3 of the paper, written directly (sinusoidal positions, tied embeddings), and
    the options Marian needs: activation, LayerNorm epsilon, unscaled embeddings, the concat
    sinusoid, a logits bias and decoding from pad (then no target pad is masked)."""
    src, tgt = np.asarray(src), np.asarray(tgt)
    emb = np.asarray(params["tgt_embed"]["embedding"], np.float64)
    d, nf, eps = cfg.d_model, cfg.norm_first, cfg.layer_norm_eps
    scale = np.sqrt(d) if cfg.scale_embeddings else 1.0
    layout = "concat" if cfg.positional == "sinusoidal_concat" else "interleaved"
    src_mask = (src != cfg.pad_id)[:, None, None, :]
    t_ = tgt.shape[1]
    tgt_keys = (tgt != cfg.pad_id) | (cfg.bos_id == cfg.pad_id)
    tgt_mask = np.tril(np.ones((t_, t_), bool))[None, None] & tgt_keys[:, None, None, :]

    def ffn(h, p):
        return _np_ffn(h, p, cfg.activation.replace("silu", "swish"))

    x = emb[src] * scale + _np_positions(src.shape[1], d, layout)
    for i in range(cfg.n_encoder_layers):
        p = params["encoder"][f"layers_{i}"]
        x = _np_sublayer(
            x,
            p["self_attn_residual"]["norm"],
            lambda h, p=p: np_multi_head_attention(h, h, p["self_attn"], src_mask, cfg.n_heads),
            nf,
            eps,
        )
        x = _np_sublayer(x, p["ffn_residual"]["norm"], lambda h, p=p: ffn(h, p["ffn"]), nf, eps)
    if nf:
        x = _np_layer_norm(x, params["encoder"]["final_norm"], eps)
    y = emb[tgt] * scale + _np_positions(t_, d, layout)
    for i in range(cfg.n_decoder_layers):
        p = params["decoder"][f"layers_{i}"]
        y = _np_sublayer(
            y,
            p["self_attn_residual"]["norm"],
            lambda h, p=p: np_multi_head_attention(h, h, p["self_attn"], tgt_mask, cfg.n_heads),
            nf,
            eps,
        )
        y = _np_sublayer(
            y,
            p["cross_attn_residual"]["norm"],
            lambda h, p=p: np_multi_head_attention(h, x, p["cross_attn"], src_mask, cfg.n_heads),
            nf,
            eps,
        )
        y = _np_sublayer(y, p["ffn_residual"]["norm"], lambda h, p=p: ffn(h, p["ffn"]), nf, eps)
    if nf:
        y = _np_layer_norm(y, params["decoder"]["final_norm"], eps)
    return y @ emb.T + (np.asarray(params["output_bias"]) if cfg.output_bias else 0.0)


def teacher_forced_nll(params, pairs, model_config) -> tuple[float, int]:
    """The per-token nll of a Transformer on `pairs` ((source ids, target ids)) the slow,
    obvious way -> (nll, target tokens): one sentence at a time (no padding), the logits of
    `np_transformer` (the model written in NumPy, float64) for <bos> + target, a plain
    log-softmax and each next token's entry, <eos> included."""
    cfg = model_config
    assert cfg.positional.startswith("sinusoidal") and cfg.share_embeddings and cfg.tie_output, (
        "np_transformer writes the paper's model: sinusoids, one shared and tied table"
    )
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    total, count = 0.0, 0
    for src, tgt in pairs:
        tgt_in = np.array([[cfg.bos_id, *tgt]])
        tgt_out = np.array([[*tgt, cfg.eos_id]])
        logits = np_transformer(params, cfg, np.array([src]), tgt_in)  # [1, T, V]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        total -= np.take_along_axis(logp, tgt_out[..., None], -1).sum()
        count += tgt_out.size
    return total / count, count


# ---------------------------------------------------------------------------- PyTorch models


def torch_xl_model(cfg, seed=0):
    """train/bench/xl_torch_reference.py's MemTransformerLM shaped as `cfg`, with random weights
    large enough (std 0.2, LayerNorm scales around 1) that every term matters."""
    import torch

    from train.bench import xl_torch_reference

    torch.manual_seed(seed)
    model = xl_torch_reference.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return model.eval()


# ---------------------------------------------------------------------------- Marian folders

MARIAN_EOS = 0  # Marian's </s>

SOURCE_TEXT = [
    "Ein Mann fährt Fahrrad.",
    "Zwei Hunde spielen im Schnee.",
    "Eine Frau liest ein Buch im Park.",
    "Kinder spielen Fußball auf der Straße.",
    "Der Hund läuft über die grüne Wiese.",
    "Ein Mann und eine Frau lachen.",
]
TARGET_TEXT = [
    "A man rides a bicycle.",
    "Two dogs play in the snow.",
    "A woman reads a book in the park.",
    "Children play football on the street.",
    "The dog runs across the green meadow.",
    "A man and a woman laugh.",
]
LANGUAGE_CODE = ">>fra<<"


def save_marian(
    folder,
    *,
    vocab_size=40,
    decoder_vocab_size=None,
    share=True,
    activation="swish",
    tie=True,
    seed=0,
):
    """A random MarianMTModel (2 + 3 layers, D 32) saved to `folder`; returns it."""
    import torch
    import transformers

    pad = (decoder_vocab_size or vocab_size) - 1
    config = transformers.MarianConfig(
        vocab_size=vocab_size,
        decoder_vocab_size=decoder_vocab_size,
        d_model=32,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        activation_function=activation,
        max_position_embeddings=64,
        scale_embedding=True,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=MARIAN_EOS,
        share_encoder_decoder_embeddings=share,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config).eval()
    # transformers initialises biases, LayerNorms and final_logits_bias to constants; random
    # values make a mix-up of any two of them visible.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_positions" in name:  # the sinusoid, not saved
                continue
            if "layer_norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
            elif "embed_tokens" in name or "shared" in name:
                p.normal_()
            else:
                p.copy_(
                    torch.randn_like(p)
                    * p.shape[-1] ** -0.5
                    * (1.0 if name.endswith("weight") else 0.1)
                )
        model.final_logits_bias.normal_()
        # Pad is the likeliest token: only its exclusion keeps it out of greedy output.
        model.final_logits_bias[0, pad] += 10.0
    model.save_pretrained(folder)
    return model


def train_spm(path, lines):
    """A SentencePiece model of `lines` written to `path`; -> its pieces."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines * 4),
        model_writer=model,
        vocab_size=60,
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())
    processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
    return [
        processor.id_to_piece(i)
        for i in range(processor.get_piece_size())
        if not (processor.is_control(i) or processor.is_unknown(i))
    ]


def marian_vocab(pieces, *, pad_last=True):
    """Marian's layout: </s> 0, <unk> 1, the pieces, <pad> last (or 2)."""
    words = ["</s>", "<unk>"] + ([] if pad_last else ["<pad>"])
    words += [p for p in dict.fromkeys(pieces) if p not in words]
    return {w: i for i, w in enumerate(words + (["<pad>"] if pad_last else []))}


def save_tokenizer(folder, *, separate=False):
    """Trains source/target SentencePiece models, saves them as transformers'
    MarianTokenizer does, and returns that tokenizer."""
    import transformers

    source = train_spm(folder / "train_source.spm", SOURCE_TEXT)
    target = train_spm(folder / "train_target.spm", TARGET_TEXT)
    kwargs = {}
    if separate:
        (folder / "train_vocab.json").write_text(json.dumps(marian_vocab(source, pad_last=False)))
        (folder / "train_target_vocab.json").write_text(
            json.dumps(marian_vocab(target, pad_last=False))
        )
        kwargs = dict(
            separate_vocabs=True, target_vocab_file=str(folder / "train_target_vocab.json")
        )
    else:
        vocab = marian_vocab(source + target + [LANGUAGE_CODE])
        (folder / "train_vocab.json").write_text(json.dumps(vocab))
    hf = transformers.MarianTokenizer(
        source_spm=str(folder / "train_source.spm"),
        target_spm=str(folder / "train_target.spm"),
        vocab=str(folder / "train_vocab.json"),
        **kwargs,
    )
    hf.save_pretrained(folder)
    return hf


# ---------------------------------------------------------------------------- calls
def calls_to(monkeypatch, owner, name: str) -> list[tuple[tuple, dict]]:
    """Wraps `owner.name` (a module's function, a method) so that each call is noted and passed
    on unchanged -> the list of calls, each (positional arguments, keyword arguments). Which
    path a program took: a kernel's or a product's calls counted while it is traced."""
    calls: list[tuple[tuple, dict]] = []
    original = getattr(owner, name)

    def noted(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, noted)
    return calls


# ---------------------------------------------------------------------------- decoding
def record_searches(monkeypatch) -> list[dict]:
    """Puts stand-ins for transformer_jax.decoding.decode's beam_search and greedy_decode,
    which note what reaches them and return outputs that end at once (EOS only), so a test
    sees the search's arguments without compiling one -> the list of calls: each the search
    ('beam' or 'greedy'), its keyword arguments, and the source's rows and padded length."""
    from transformer_jax.decoding import decode  # lazy, as the other helpers' imports

    calls: list[dict] = []

    def ended(model, rows: int, max_len: int) -> np.ndarray:
        return np.full((rows, max_len), model.config.eos_id, np.int32)  # [N, O]

    def beam_search(model, params, src, **kwargs):
        rows, length = src.shape
        calls.append(dict(kwargs, search="beam", rows=rows, src_len=length))
        return ended(model, rows, kwargs["max_len"])[:, None], np.zeros((rows, 1), np.float32)

    def greedy_decode(model, params, src, *, max_len):
        rows, length = src.shape
        calls.append(dict(search="greedy", max_len=max_len, rows=rows, src_len=length))
        return ended(model, rows, max_len)

    monkeypatch.setattr(decode, "beam_search", beam_search)
    monkeypatch.setattr(decode, "greedy_decode", greedy_decode)
    return calls


# ---------------------------------------------------------------------------- subprocesses
# Every wait on a subprocess has a deadline that applies whether or not the process prints, and
# a process is killed and reaped when its `with` block ends: a thread reads its output line by
# line into a queue (a `for line in proc.stdout` loop would check its deadline only when a line
# arrives), so a process that prints a lot never blocks on a full pipe either.
TIMEOUT = 300  # seconds for any one wait: a guard against a hang, never a verdict


class Running:
    """A process in the background whose output (stdout and stderr together) is read line by
    line; waits on it are bounded, and leaving the `with` block kills it if still alive."""

    def __init__(self, args, env, cwd=REPO):
        self.proc = subprocess.Popen(
            args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_for(self, text: str, timeout: float = TIMEOUT) -> str:
        """The first line from now on that contains `text`; an AssertionError if the process
        exits first or none comes within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no {text!r} within {timeout}s:\n{self.output}") from None
            if line is None:
                raise AssertionError(f"exited ({self.proc.wait()}) before {text!r}:\n{self.output}")
            if text in line:
                return line

    def finish(self, timeout: float = TIMEOUT) -> int:
        """Waits for the exit (killing the process past `timeout`) -> its exit code, with all
        of its output read."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout}s:\n{self.output}") from None
        self._reader.join(timeout=30)
        return rc

    def send_signal(self, signum: int):
        self.proc.send_signal(signum)

    def kill9(self) -> int:
        self.proc.send_signal(signal.SIGKILL)
        return self.finish()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._reader.join(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def finish_all(procs: list[Running], timeout: float = TIMEOUT, grace: float = 60) -> list[int]:
    """Waits until every process of `procs` has exited -> their exit codes. Once one has
    failed, the others get `grace` seconds (a peer of a failed process may wait for it in a
    collective until JAX's own timeouts), then are killed (a negative code). Past `timeout`
    all are killed and an AssertionError shows each one's output (a hang is a failure)."""
    deadline, give_up = time.monotonic() + timeout, None
    while any(p.alive() for p in procs):
        now = time.monotonic()
        if now > deadline:
            for p in procs:
                p.kill()
            raise AssertionError(
                f"not finished within {timeout}s:\n"
                + "\n".join(f"--- process {i}:\n{p.output[-3000:]}" for i, p in enumerate(procs))
            )
        if give_up is None and any(p.proc.poll() not in (None, 0) for p in procs):
            give_up = now + grace
        if give_up is not None and now > give_up:
            for p in procs:
                p.kill()
            break
        time.sleep(0.05)
    return [p.finish() for p in procs]


def full_size_residuals(f, *args, shape) -> int:
    """How many arrays of `shape` the forward pass of f(*args) keeps for its backward pass
    (the leaves of the VJP closure `jax.vjp` returns are its residuals)."""
    _, vjp = jax.vjp(f, *args)
    return sum(leaf.shape == shape for leaf in jax.tree.leaves(vjp))
