"""Translation as a `train.core.task.Task`: Multi30k German -> English with any model of the
registry. Data: a joint SentencePiece tokenizer, length-bucketed token batches, the evaluation
splits; loss: label-smoothed cross-entropy; evaluation: teacher-forced perplexity on
validation, then on the test split perplexity and the sacreBLEU of beam search, with the
translations written to W/translations/ and plots to W/plots/.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from train import plots
from train.core.metrics import MetricsWriter
from train.core.parallel import DataParallel
from train.core.state import TrainState
from train.core.workdir import local_dir
from train.data.batching import TokenBatcher, eval_batches
from train.data.tokenizers import multi30k_tokenizer
from train.translate import registry
from train.translate.config import PRESETS, TranslateConfig, make_config
from train.translate.evaluate import bleu, teacher_forced, translate_pairs, write_translations
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


def load_tokenizer(config: TranslateConfig, workdir: str):
    return multi30k_tokenizer(
        config.tokenizer_dir or os.path.join(local_dir(workdir), "tokenizer"),
        vocab_size=config.vocab_size,
        data_dir=config.data_dir,
    )


def encode_source(tokenizer, sentences: Sequence[str]) -> list[list[int]]:
    # The source ends with eos, so the encoder sees where the sentence stops (as fairseq does).
    return [ids + [tokenizer.eos_id] for ids in tokenizer.encode_batch(list(sentences))]


def encode_pairs(tokenizer, pairs: Sequence[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    return list(
        zip(
            encode_source(tokenizer, [p[0] for p in pairs]),
            tokenizer.encode_batch([p[1] for p in pairs]),
        )
    )


def load_split(config: TranslateConfig, tokenizer, name: str) -> Split:
    from train.data.datasets import load_multi30k  # lazy: importing TFDS is not free

    pairs = load_multi30k(name, data_dir=config.data_dir)
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
    test: Split
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

    def _eval_batches(self, split: Split, dp: DataParallel):
        return eval_batches(
            split.pairs,
            batch_size=self.eval_rows,
            buckets=self.config.buckets,
            num_devices=dp.n_devices,
        )

    def evaluate(self, dp: DataParallel, eval_step: Callable, params) -> dict[str, float]:
        return teacher_forced(dp, eval_step, params, self._eval_batches(self.validation, dp))

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
        config, test, log = self.config, self.test, self.log
        step = int(jax.device_get(state.step))
        out = {f"val_{k}": v for k, v in validation.items() if k in ("loss", "nll", "ppl")}
        t_eval = time.monotonic()
        test_tf = teacher_forced(dp, eval_step, params, self._eval_batches(test, dp))
        hypotheses = translate_pairs(model, params, dp, config, self.tokenizer, test.pairs)
        score = bleu(hypotheses, test.references)
        path = write_translations(
            workdir,
            config.test_split,
            step,
            sources=test.sources,
            references=test.references,
            hypotheses=hypotheses,
        )
        record = {
            "loss": test_tf["loss"],
            "nll": test_tf["nll"],
            "ppl": test_tf["ppl"],
            "bleu": score,
            "sentences": len(hypotheses),
            "beam_size": config.beam_size,
            "eval_seconds": time.monotonic() - t_eval,
            "total_seconds": time.monotonic() - start,
        }
        writer.write_final(step, config.test_split, record)
        out.update({f"test_{k}": v for k, v in record.items()})
        out["hypotheses"] = path
        log(
            f"{config.test_split}: BLEU {score:.2f} (sacreBLEU, cased, 13a, beam "
            f"{config.beam_size}), ppl {test_tf['ppl']:.2f}; validation ppl "
            f"{validation['ppl']:.2f}; translations in {path}"
        )
        if config.plots and jax.process_index() == 0:
            made = plots.make_translation_plots(
                workdir,
                model,
                params,
                self.tokenizer,
                source=test.sources[0],
                hypothesis=hypotheses[0],
            )
            first = next(iter(self._eval_batches(self.validation, dp)))
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


class TranslationTask:
    """`train.core.task.Task` for Multi30k translation."""

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

    def describe(self, config: TranslateConfig) -> str:
        return config.model

    def prepare(
        self, config: TranslateConfig, workdir: str, dp: DataParallel, log: Callable[[str], None]
    ) -> TranslationData:
        from train.data.datasets import load_multi30k  # lazy: importing TFDS is not free

        tokenizer = load_tokenizer(config, workdir)
        train_pairs = encode_pairs(tokenizer, load_multi30k("train", data_dir=config.data_dir))
        batcher = TokenBatcher(
            train_pairs,
            tokens_per_batch=config.tokens_per_batch,
            buckets=config.buckets,
            num_devices=dp.n_devices,
            seed=config.seed,
        )
        data = TranslationData(
            config=config,
            tokenizer=tokenizer,
            batcher=batcher,
            validation=load_split(config, tokenizer, "validation"),
            test=load_split(config, tokenizer, config.test_split),
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


TASK = TranslationTask()
