"""Translation as a `train.core.task.Task` with any model of the registry, on Multi30k
(German -> English, or back), a prepared TFDS translation dataset or the user's parallel text
files. Data: a joint SentencePiece tokenizer, length-bucketed token batches, the evaluation
splits; loss: label-smoothed cross-entropy; evaluation: teacher-forced perplexity on
validation, then on each test set perplexity, and sacreBLEU and chrF of beam search, with the
translations written to W/translations/ and plots to W/plots/.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import itertools
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from train import plots
from train.core.metrics import MetricsWriter, read_metrics
from train.core.parallel import DataParallel
from train.core.state import TrainState
from train.core.workdir import local_dir
from train.data.batching import TokenBatcher, eval_batches
from train.data.text_files import (
    DataError,
    check_fingerprint,
    files_sha256,
    read_parallel,
    set_name,
)
from train.data.tfds_source import TfdsDataset, open_dataset
from train.data.token_cache import (
    CACHE_DIR,
    PairSource,
    cache_key,
    file_pairs,
    pairs_cache,
    sample_pairs,
)
from train.data.tokenizers import (
    SentencePieceTokenizer,
    model_file_name,
    multi30k_tokenizer,
    write_model,
)
from train.translate import registry
from train.translate.config import PRESETS, TranslateConfig, make_config
from train.translate.evaluate import (
    bleu,
    chrf,
    special_ids,
    teacher_forced,
    translate_pairs,
    write_translations,
)
from transformer_jax.interchange.marian import check_tokenizer, marian_params, read_marian_weights
from transformer_jax.interchange.marian_tokenizer import MarianTokenizer, has_tokenizer_files
from transformer_jax.losses import (
    hard_attention_surrogate,
    init_reinforce_baseline,
    label_smoothed_cross_entropy,
)
from transformer_jax.optim import make_schedule


@dataclasses.dataclass
class Split:
    """One evaluation split: raw sentences and their encoded pairs (src ids end with eos)."""

    name: str
    sources: list[str]
    references: list[str]
    pairs: list[tuple[list[int], list[int]]]


# The metrics split (prefix) of a pretrained model's figures before fine-tuning.
PRETRAINED = "pretrained"


def _gain(before: Mapping[str, float] | None) -> str:
    """' (BLEU b, chrF c before fine-tuning)' for a log line, or ''."""
    if not before:
        return ""
    return f" (BLEU {before['bleu']:.2f}, chrF {before['chrf']:.2f} before fine-tuning)"


def multi30k_pairs(config: TranslateConfig, split: str) -> list[tuple[str, str]]:
    """A Multi30k split as (source, target) in the configured direction (de-en or en-de)."""
    from train.data.datasets import load_multi30k  # lazy: importing TFDS is not free

    pairs = load_multi30k(split, data_dir=config.data_dir)
    return pairs if config.src_lang == "de" else [(en, de) for de, en in pairs]


def tfds_pairs(config: TranslateConfig, data: TfdsDataset | None = None) -> PairSource:
    """A TFDS dataset's training split as a stream of pairs; those with an empty side are left
    out and counted (a published corpus has a few, and there is no file to fix), and a split
    with none left is a DataError at the end of the stream.

    Its fingerprint: the sha256 of the prepared copy's dataset_info.json (its version, splits
    and sizes: what `check_fingerprint` keeps), the dataset's full name, the split and the
    direction."""
    data = data or open_tfds(config)
    split, languages = data.splits().train, (config.src_lang, config.tgt_lang)

    def read(skipped: list[int]) -> Iterator[tuple[str, str]]:
        skipped[:] = [0]
        kept = 0
        for s, t in data.iter_read(split, languages):
            if s.strip() and t.strip():
                kept += 1
                yield s, t
            else:
                skipped[0] += 1
        if not kept:
            raise DataError(f"{config.dataset}: no training pair with text on both sides")

    return PairSource(
        read=read,
        fingerprint={
            "dataset_sha256": files_sha256(data.info_path),
            "dataset": data.builder.info.full_name,  # name/config/version
            "split": split,
            "languages": list(languages),
        },
        origin={"dataset": config.dataset, "split": split},
    )


def open_tfds(config: TranslateConfig) -> TfdsDataset:
    """The run's prepared TFDS dataset, checked to hold both languages."""
    data = open_dataset(config.dataset, config.data_dir)
    data.check_text_features(
        (config.src_lang, config.tgt_lang), field="src_lang, tgt_lang", what="language"
    )
    return data


def load_tokenizer(config: TranslateConfig, workdir: str) -> SentencePieceTokenizer:
    """The run's tokenizer: a pretrained model's own (`pretrained_tokenizer`), else the joint
    SentencePiece model of Multi30k, or the one trained on a sample of the training files' or
    TFDS split's sentences the first time (`sampled_tokenizer`)."""
    directory = tokenizer_dir(config, workdir)
    if config.pretrained is not None:
        return pretrained_tokenizer(config, directory)
    if config.data_source() == "multi30k":
        return multi30k_tokenizer(directory, vocab_size=config.vocab_size, data_dir=config.data_dir)
    if config.data_source() == "tfds":
        return sampled_tokenizer(config, directory, tfds_pairs(config), name="tfds")
    return files_tokenizer(config, directory)


def trained_tokenizer(config: TranslateConfig, workdir: str):
    """The tokenizer a trained run encodes with, for translating and exporting it: the one
    SentencePiece model of the run's kind in its tokenizer folder, read without touching the
    training data. Finding it by `load_tokenizer` hashes the data (all of Multi30k's train split,
    2.6 s; every byte of the user's training files), and fails once those files are gone.
    Falls back to `load_tokenizer` when the folder holds none of that kind, or several (a
    tokenizer_dir that runs on different data share)."""
    if config.pretrained is None:
        # The tokenizer's name is its data source's (load_tokenizer: multi30k, tfds, files).
        pattern = model_file_name(f"{config.data_source()}_spm", config.vocab_size, "*")
        found = glob.glob(os.path.join(glob.escape(tokenizer_dir(config, workdir)), pattern))
        if len(found) == 1:
            return SentencePieceTokenizer(found[0])
    return load_tokenizer(config, workdir)


def tokenizer_dir(config: TranslateConfig, workdir: str) -> str:
    """Where the run's SentencePiece model is kept: tokenizer_dir, else W/tokenizer (the local
    copy of a remote W)."""
    return config.tokenizer_dir or os.path.join(local_dir(workdir), "tokenizer")


def pretrained_tokenizer(config: TranslateConfig, directory: str) -> MarianTokenizer:
    """A fine-tuning run's tokenizer: the pretrained folder's, copied to directory/marian the
    first time (so the run no longer needs the folder), and checked against the model's
    config (pad and EOS ids, vocabulary size)."""
    copy = os.path.join(directory, "marian")
    if not has_tokenizer_files(copy):
        if not has_tokenizer_files(config.pretrained):
            raise DataError(
                f"pretrained: {config.pretrained} has no tokenizer (source.spm, target.spm, "
                "vocab.json); fine-tuning encodes the data with the model's own"
            )
        MarianTokenizer.from_folder(config.pretrained).save(copy)
    tokenizer = MarianTokenizer.from_folder(copy)
    check_tokenizer(tokenizer, config.model_config, source=copy)
    return tokenizer


def files_tokenizer(
    config: TranslateConfig, directory: str, *, train_sha256: str | None = None
) -> SentencePieceTokenizer:
    """`sampled_tokenizer` of the training files (train_sha256: their `files_sha256`, computed
    when not given)."""
    files = (config.train_src, config.train_tgt)
    source = file_pairs(
        *files, train_sha256=train_sha256 or files_sha256(*files), skip_empty=config.skip_empty
    )
    return sampled_tokenizer(config, directory, source, name="files")


def sampled_tokenizer(
    config: TranslateConfig, directory: str, source: PairSource, *, name: str
) -> SentencePieceTokenizer:
    """The joint model of `source`'s pairs, trained on at most spm_sample of their sentences
    (`token_cache.sample_pairs`, one pass over the stream) the first time, and named by a hash
    of the source's fingerprint and the options, so finding it reads no sentence."""
    key = cache_key(
        **source.fingerprint, vocab_size=config.vocab_size, spm_sample=config.spm_sample
    )
    path = os.path.join(directory, model_file_name(f"{name}_spm", config.vocab_size, key[:12]))
    if not os.path.exists(path):
        sentences, _ = sample_pairs(source.read([0]), sample=config.spm_sample)
        try:
            write_model(path, sentences, vocab_size=config.vocab_size)
        except ValueError as e:  # SentencePiece cannot meet the vocabulary size on this text
            raise DataError(f"vocab_size: {e}") from e
    return SentencePieceTokenizer(path)


def encode_source(tokenizer, sentences: Sequence[str]) -> list[list[int]]:
    # The source ends with eos, so the encoder sees where the sentence stops (as fairseq does).
    return [ids + [tokenizer.eos_id] for ids in tokenizer.encode_batch(list(sentences))]


def encode_pairs(tokenizer, pairs: Sequence[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    return list(
        zip(
            encode_source(tokenizer, [p[0] for p in pairs]),
            tokenizer.encode_targets([p[1] for p in pairs]),
        )
    )


def load_split(
    config: TranslateConfig,
    tokenizer,
    name: str,
    files: tuple[str, str] | None = None,
    log: Callable[[str], None] | None = None,
    *,
    pairs: Sequence[tuple[str, str]] | None = None,
) -> Split:
    """An evaluation split: Multi30k's split `name`, or the parallel `files` (source, target)
    or the `pairs` (of a TFDS split) under that name; its first eval_sentences pairs when
    set."""
    if pairs is not None:
        pairs = list(pairs)
    elif files is None:
        pairs = multi30k_pairs(config, name)
    else:
        pairs, skipped = read_parallel(*files, skip_empty=config.skip_empty)
        if skipped and log:
            log(f"data: {name}: {skipped:,} pair(s) with an empty side left out (skip_empty)")
    if config.eval_sentences:
        pairs = pairs[: config.eval_sentences]
    return Split(name, [p[0] for p in pairs], [p[1] for p in pairs], encode_pairs(tokenizer, pairs))


def make_loss_fn(
    model: nn.Module,
    *,
    smoothing: float,
    pad_id: int,
    aux_loss: str | None = None,
    free_running: bool = False,
):
    """The train.core.step loss protocol for a translation model on {'src','tgt_in','tgt_out'}
    (and 'teacher_forcing' [B], the step's ratio, when free_running): label-smoothed
    cross-entropy summed over real target tokens, plus the unsmoothed nll.

    aux_loss 'hard_attention_surrogate': in training, hard attention's REINFORCE term is added
    to the differentiated sum (not to the reported nll), and its moving-average baseline is the
    carried state `extra`.
    """

    def loss_fn(params, batch, *, rng, extra, deterministic):
        rngs, kwargs = None, {}
        if not deterministic:
            rngs = {"dropout": rng}
            if aux_loss or free_running:  # positions and teacher-forcing coins
                rngs["sample"] = jax.random.fold_in(rng, 1)
            if free_running:
                kwargs["teacher_forcing"] = batch["teacher_forcing"][0]
        if aux_loss and not deterministic:
            logits, aux = model.apply(
                {"params": params},
                batch["src"],
                batch["tgt_in"],
                deterministic=False,
                rngs=rngs,
                method="logits_and_attention",
                **kwargs,
            )
        else:
            logits, aux = (
                model.apply(
                    {"params": params},
                    batch["src"],
                    batch["tgt_in"],
                    deterministic=deterministic,
                    rngs=rngs,
                    **kwargs,
                ),
                None,
            )
        loss_sum, n_tokens = label_smoothed_cross_entropy(
            logits, batch["tgt_out"], smoothing=smoothing, pad_id=pad_id
        )
        if smoothing:
            nll_sum, _ = label_smoothed_cross_entropy(
                logits, batch["tgt_out"], smoothing=0.0, pad_id=pad_id
            )
        else:
            nll_sum = loss_sum
        sums = {"n_tokens": n_tokens.astype(jnp.float32), "nll_sum": nll_sum}
        if aux is not None:
            surrogate, extra = hard_attention_surrogate(
                logits, batch["tgt_out"], aux, extra, pad_id=pad_id
            )
            sums["loss_sum"] = loss_sum  # reported; the surrogate is there for its gradient
            loss_sum = loss_sum + surrogate
        return loss_sum, sums, extra

    return loss_fn


@dataclasses.dataclass
class TranslationData:
    """The data of one run: the training batcher, validation and test splits (TaskData)."""

    config: TranslateConfig
    tokenizer: Any
    batcher: TokenBatcher
    validation: Split
    tests: list[Split]  # each scored and written under its own name; may be empty
    eval_rows: int
    log: Callable[[str], None] = print

    def batches(self, start_step: int, rows=None):
        if not self.config.uses_teacher_forcing():
            yield from self.batcher.iterate(start_step, rows)
            return
        for step, batch in enumerate(self.batcher.iterate(start_step, rows), start_step):
            yield self._with_ratio(batch, step)

    def example_batches(self, rows=None) -> list[dict[str, np.ndarray]]:
        """One batch of each of the batcher's shapes, as `batches(..., rows)` yields them."""
        examples = self.batcher.example_batches(rows)
        if self.config.uses_teacher_forcing():
            examples = [self._with_ratio(batch, 0) for batch in examples]
        return examples

    def _with_ratio(self, batch, step: int):
        # The step's teacher-forcing ratio rides with its batch (one copy per row, so it
        # shards like one).
        return dict(
            batch,
            teacher_forcing=np.full(
                (batch["src"].shape[0],), self.config.teacher_forcing_at(step), np.float32
            ),
        )

    def _eval_batches(self, split: Split, dp: DataParallel, *, sort_by_length: bool = True):
        """The split's pairs in evaluation batches. Sorted by length (the default), a batch
        pads to the bucket of pairs of about its own length: in the split's own order nearly
        every 128-row batch of test_2016_flickr held one long pair and padded to 48 or 64
        positions, and the teacher-forced pass took twice as long
        (`benchmarks/decode_2026-11-27_amd25/`). The sums are the same pairs', added in
        another order."""
        return eval_batches(
            split.pairs,
            batch_size=self.eval_rows,
            buckets=self.config.buckets,
            num_devices=dp.n_devices,
            sort_by_length=sort_by_length,
            **special_ids(self.config.model_config),
        )

    def evaluate(self, dp: DataParallel, eval_step: Callable, params) -> dict[str, float]:
        return teacher_forced(dp, eval_step, params, self._eval_batches(self.validation, dp))

    def start(
        self,
        *,
        workdir: str,
        dp: DataParallel,
        eval_step: Callable,
        model: nn.Module,
        params,
        writer: MetricsWriter,
    ) -> None:
        """A fine-tuning run's starting point, before its first step: perplexity, BLEU and
        chrF of the pretrained model on validation and each test set, logged and written as
        step 0 of split 'pretrained/NAME' (its translations as step 0's), so the end's figures
        show the gain. A model trained from scratch starts random: nothing is measured."""
        if self.config.pretrained is None:
            return
        score = self._scorer(
            workdir=workdir, dp=dp, eval_step=eval_step, model=model, params=params, step=0
        )
        for split in (self.validation, *self.tests):
            record, path, _ = score(split)
            writer.write_final(0, f"{PRETRAINED}/{split.name}", record)
            self.log(
                f"{split.name} before fine-tuning: BLEU {record['bleu']:.2f}, chrF "
                f"{record['chrf']:.2f}, ppl {record['ppl']:.2f}; translations in {path}"
            )

    def finish(
        self,
        *,
        workdir: str,
        dp: DataParallel,
        eval_step: Callable,
        model: nn.Module,
        state: TrainState,
        params,
        validation: Mapping[str, float],
        writer: MetricsWriter,
        start: float,
    ) -> dict[str, Any]:
        config, log = self.config, self.log
        step = int(jax.device_get(state.step))
        score = self._scorer(
            workdir=workdir, dp=dp, eval_step=eval_step, model=model, params=params, step=step
        )
        out = {f"val_{k}": v for k, v in validation.items() if k in ("loss", "nll", "ppl")}
        before = self._before(writer) if config.pretrained is not None else {}
        if config.pretrained is not None:  # the gain of fine-tuning: validation BLEU too
            record, path, _ = score(self.validation)
            writer.write_final(step, "validation_bleu", record)
            out.update({f"val_{k}": record[k] for k in ("bleu", "chrf")})
            out.update({f"start_val_{k}": v for k, v in before.get("validation", {}).items()})
            log(
                f"validation: BLEU {record['bleu']:.2f}, chrF {record['chrf']:.2f}"
                + _gain(before.get("validation"))
                + f"; translations in {path}"
            )
        first = None
        for test in self.tests:
            record, path, hypotheses = score(test)
            record["total_seconds"] = time.monotonic() - start
            writer.write_final(step, test.name, record)
            started = before.get(test.name)
            if first is None:  # the first test set's figures are the run's test_ figures
                first = (test, hypotheses)
                out.update({f"test_{k}": v for k, v in record.items()})
                out["hypotheses"] = path
                out.update({f"start_test_{k}": v for k, v in (started or {}).items()})
            if len(self.tests) > 1:
                out.update({f"test_{test.name}_{k}": record[k] for k in ("bleu", "chrf", "ppl")})
            log(
                f"{test.name}: BLEU {record['bleu']:.2f} (sacreBLEU, cased, 13a, beam "
                f"{config.beam_size}), chrF {record['chrf']:.2f}, ppl {record['ppl']:.2f}"
                + _gain(started)
                + f"; validation ppl {validation['ppl']:.2f}; translations in {path}"
            )
        if first is None:
            log(f"no test set; validation ppl {validation['ppl']:.2f}")
        if config.plots and first is not None and jax.process_index() == 0:
            test, hypotheses = first
            made = plots.make_translation_plots(
                workdir,
                model,
                params,
                self.tokenizer,
                source=test.sources[0],
                hypothesis=hypotheses[0],
            )
            first = next(iter(self._eval_batches(self.validation, dp, sort_by_length=False)))
            made += [
                d.path
                for d in plots.make_annotated_transformer_plots(
                    os.path.join(workdir, plots.PLOTS_DIR),
                    src=first["src"][:8],
                    tgt_in=first["tgt_in"][:8],
                    pad_id=config.model_config.pad_id,
                    schedules={config.optimizer: make_schedule(config.optimizer_config())},
                    steps=max(step, 1),
                    smoothing=config.label_smoothing,
                )
            ]
            log(
                f"plots: {', '.join(os.path.basename(p) for p in made)} in "
                f"{os.path.join(workdir, plots.PLOTS_DIR)}"
            )
        return out

    def _before(self, writer: MetricsWriter) -> dict[str, dict[str, float]]:
        """The pretrained model's BLEU and chrF per split, as `start` wrote them (on process 0,
        which writes the metrics; empty elsewhere)."""
        prefix = f"{PRETRAINED}/"
        return {
            r["split"][len(prefix) :]: {k: r[k] for k in ("bleu", "chrf")}
            for r in read_metrics(writer.path)
            if r["split"].startswith(prefix) and r["step"] == 0
        }

    def _scorer(self, **context) -> Callable[[Split], tuple[dict[str, Any], str, list[str]]]:
        """`_score` of one split with the rest of its arguments (`context`) bound."""
        return functools.partial(self._score, **context)

    def _score(self, test: Split, *, workdir: str, dp, eval_step, model, params, step: int):
        """-> (the metrics record of one test set, its translations' path, the hypotheses)."""
        config = self.config
        t_eval = time.monotonic()
        teacher = teacher_forced(dp, eval_step, params, self._eval_batches(test, dp))
        hypotheses = translate_pairs(model, params, dp, config, self.tokenizer, test.pairs)
        src_lang, tgt_lang = config.output_languages()
        path = write_translations(
            workdir,
            test.name,
            step,
            sources=test.sources,
            references=test.references,
            hypotheses=hypotheses,
            src_lang=src_lang,
            tgt_lang=tgt_lang,
        )
        record = {
            "loss": teacher["loss"],
            "nll": teacher["nll"],
            "ppl": teacher["ppl"],
            "bleu": bleu(hypotheses, test.references),
            "chrf": chrf(hypotheses, test.references),
            "sentences": len(hypotheses),
            "beam_size": config.beam_size,
            "eval_seconds": time.monotonic() - t_eval,
        }
        return record, path, hypotheses


class TranslationTask:
    """`train.core.task.Task` for translation (Multi30k, a TFDS dataset or files)."""

    name = "translate"
    choice_flag = "model"
    default_choice = "transformer"
    config_cls = TranslateConfig
    presets = tuple(PRESETS)

    def choices(self) -> list[str]:
        return registry.names()

    def model_config_cls(self, choice: str) -> type:
        return registry.get(choice).config_cls

    def make_config(
        self, choice: str, preset: str, *, model_overrides: Mapping[str, Any] = (), **run_overrides
    ) -> TranslateConfig:
        return make_config(choice, preset, model_overrides=model_overrides, **run_overrides)

    def build_model(self, config: TranslateConfig) -> nn.Module:
        return registry.get(config.model).module_cls(config.model_config)

    def optimizer_config(self, config: TranslateConfig):
        return config.optimizer_config()

    def init_params(self, config: TranslateConfig, model: nn.Module, rng):
        dummy = jnp.ones((1, 8), jnp.int32)
        extra = init_reinforce_baseline() if registry.get(config.model).aux_loss else None
        return model.init({"params": rng}, dummy, dummy)["params"], extra

    def loss_fn(self, config: TranslateConfig, model: nn.Module):
        return make_loss_fn(
            model,
            smoothing=config.label_smoothing,
            pad_id=config.model_config.pad_id,
            aux_loss=registry.get(config.model).aux_loss,
            free_running=config.uses_teacher_forcing(),
        )

    def initial_params(self, config: TranslateConfig):
        """A pretrained model's weights (checked against its config), else None."""
        if config.pretrained is None:
            return None
        return marian_params(read_marian_weights(config.pretrained), config.model_config)

    def describe(self, config: TranslateConfig) -> str:
        if config.pretrained is not None:
            return f"{config.model} fine-tuned from {config.pretrained}"
        return config.model

    def prepare(
        self, config: TranslateConfig, workdir: str, dp: DataParallel, log: Callable[[str], None]
    ) -> TranslationData:
        if config.data_source() == "multi30k":
            tokenizer = load_tokenizer(config, workdir)
            encoded = encode_pairs(tokenizer, multi30k_pairs(config, "train"))
        else:  # files or a TFDS split: streamed into the token cache
            encoded, tokenizer = _cached_pairs(config, workdir, log)
        batcher = TokenBatcher(
            encoded,
            tokens_per_batch=config.tokens_per_batch,
            buckets=config.buckets,
            num_devices=dp.n_devices,
            seed=config.seed,
            **special_ids(config.model_config),
        )
        if config.uses_files():
            validation = load_split(
                config, tokenizer, "validation", (config.valid_src, config.valid_tgt), log
            )
            names = unique_names([set_name(src) for src in config.test_src])
            tests = [
                load_split(config, tokenizer, name, files, log)
                for name, files in zip(names, zip(config.test_src, config.test_tgt))
            ]
        elif config.data_source() == "tfds":
            validation, tests = tfds_splits(config, tokenizer)
        else:
            validation = load_split(config, tokenizer, "validation")
            tests = [load_split(config, tokenizer, config.test_split)]
        data = TranslationData(
            config=config,
            tokenizer=tokenizer,
            batcher=batcher,
            validation=validation,
            tests=tests,
            eval_rows=dp.round_rows(config.eval_batch_size),
            log=log,
        )
        log(
            f"data: {batcher.num_examples} training pairs ({batcher.num_dropped} too long), "
            f"{batcher.num_batches} batches an epoch; vocabulary {tokenizer.vocab_size}; "
            f"{len(batcher.shape_set())} batch shapes to compile: {batcher.shape_set()}; "
            f"{dp.n_devices} device(s), {config.parallel}"
        )
        return data


def tfds_splits(config: TranslateConfig, tokenizer) -> tuple[Split, list[Split]]:
    """A TFDS run's validation split and its test set ('<NAME>.test'; none without one), in
    memory: only their first eval_sentences pairs are read when that is set."""
    data = open_tfds(config)
    splits, languages = data.splits(), (config.src_lang, config.tgt_lang)

    def head(split: str) -> list[tuple[str, str]]:
        pairs = data.iter_read(split, languages)
        return list(itertools.islice(pairs, config.eval_sentences or None))

    validation = load_split(config, tokenizer, "validation", pairs=head(splits.validation))
    if splits.test is None:
        return validation, []
    name = f"{data.name}.{splits.test}"
    return validation, [load_split(config, tokenizer, name, pairs=head(splits.test))]


def _cached_pairs(config: TranslateConfig, workdir: str, log: Callable[[str], None]):
    """-> (the training pairs of the files or the TFDS split from the token cache,
    memory-mapped; the tokenizer): the corpus is streamed, never held as strings
    (train.data.token_cache). A resumed run checks the files' bytes (or the prepared copy's
    dataset_info.json) against W/data.json first."""
    if config.uses_files():
        digest = check_fingerprint(
            workdir, {"train_src": config.train_src, "train_tgt": config.train_tgt}
        )
        source = file_pairs(
            config.train_src, config.train_tgt, train_sha256=digest, skip_empty=config.skip_empty
        )
        name, why = "files", " (skip_empty)"
    else:
        data = open_tfds(config)
        check_fingerprint(workdir, {"dataset": data.info_path})
        if data.splits().note:
            log(f"data: {config.dataset}: {data.splits().note}")
        source, name, why = tfds_pairs(config, data), "tfds", ""
    if config.pretrained is not None:
        tokenizer = load_tokenizer(config, workdir)
    else:
        tokenizer = sampled_tokenizer(config, tokenizer_dir(config, workdir), source, name=name)
    pairs, meta = pairs_cache(
        source, tokenizer, config.cache_dir or os.path.join(workdir, CACHE_DIR), log=log
    )
    if meta["skipped"]:
        log(f"data: {meta['skipped']:,} training pair(s) with an empty side left out{why}")
    return pairs, tokenizer


def unique_names(names: Sequence[str]) -> list[str]:
    """Test set names made unique (a second 'test' becomes 'test.2')."""
    out, seen = [], {}
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}.{seen[name]}")
    return out


TASK = TranslationTask()
