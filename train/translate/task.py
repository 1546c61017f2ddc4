"""Translation as a `train.core.task.Task` with any model of the registry, on Multi30k
(German -> English, or back), a prepared TFDS translation dataset or the user's parallel text
files (`sources`). Data: the run's tokenizer (`tokenizer`), length-bucketed token batches, the
evaluation splits; loss: label-smoothed cross-entropy (`loss`); evaluation: teacher-forced
perplexity on validation, then on each test set perplexity, and sacreBLEU and chrF of beam
search, with the translations written to W/translations/ and plots to W/plots/.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from train import plots
from train.core.metrics import MetricsWriter, read_metrics
from train.core.parallel import DataParallel
from train.core.task import EvalContext
from train.data.batching import TokenBatcher, eval_batches
from train.data.token_cache import CACHE_DIR
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
from train.translate.loss import make_loss_fn
from train.translate.sources import Split, translation_source
from train.translate.tokenizer import load_tokenizer
from transformer_jax.losses import init_reinforce_baseline
from transformer_jax.optim import make_schedule

# The metrics split (prefix) of a pretrained model's figures before fine-tuning.
PRETRAINED = "pretrained"


def _gain(before: Mapping[str, float] | None) -> str:
    """' (BLEU b, chrF c before fine-tuning)' for a log line, or ''."""
    if not before:
        return ""
    return f" (BLEU {before['bleu']:.2f}, chrF {before['chrf']:.2f} before fine-tuning)"


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
        """The split's pairs in evaluation batches, sorted by length by default: a batch then
        pads to its own pairs' bucket, not its longest outlier's
        (`benchmarks/decode_2026-11-27_amd25/`). The same sums, in another order."""
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

    def start(self, ctx: EvalContext, params) -> None:
        """A fine-tuning run's starting point, before its first step: perplexity, BLEU and
        chrF of the pretrained model on validation and each test set, logged and written as
        step 0 of split 'pretrained/NAME' (its translations as step 0's), so the end's figures
        show the gain. A model trained from scratch starts random: nothing is measured."""
        if not self.config.origin.has_baseline:
            return
        for split in (self.validation, *self.tests):
            record, path, _ = self._score(split, ctx, params, step=0)
            ctx.writer.write_final(0, f"{PRETRAINED}/{split.name}", record)
            self.log(
                f"{split.name} before fine-tuning: BLEU {record['bleu']:.2f}, chrF "
                f"{record['chrf']:.2f}, ppl {record['ppl']:.2f}; translations in {path}"
            )

    def finish(
        self, ctx: EvalContext, step: int, params, validation: Mapping[str, float]
    ) -> dict[str, Any]:
        config, log, writer, workdir = self.config, self.log, ctx.writer, ctx.workdir
        score = functools.partial(self._score, ctx=ctx, params=params, step=step)
        out = {f"val_{k}": v for k, v in validation.items() if k in ("loss", "nll", "ppl")}
        before = self._before(writer) if config.origin.has_baseline else {}
        if config.origin.has_baseline:  # the gain of fine-tuning: validation BLEU too
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
            record["total_seconds"] = time.monotonic() - ctx.started
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
            schedule = config.optimizer_config()
            if schedule.horizon_in_state:  # fitted to the budget: drawn over the steps it took
                schedule = dataclasses.replace(
                    schedule, decay_steps=max(step, 1), horizon_in_state=False
                )
            test, hypotheses = first
            made = plots.make_translation_plots(
                workdir,
                ctx.model,
                params,
                self.tokenizer,
                source=test.sources[0],
                hypothesis=hypotheses[0],
            )
            first = next(iter(self._eval_batches(self.validation, ctx.dp, sort_by_length=False)))
            made += [
                d.path
                for d in plots.make_annotated_transformer_plots(
                    os.path.join(workdir, plots.PLOTS_DIR),
                    src=first["src"][:8],
                    tgt_in=first["tgt_in"][:8],
                    pad_id=config.model_config.pad_id,
                    schedules={config.optimizer: make_schedule(schedule)},
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

    def _score(self, test: Split, ctx: EvalContext, params, *, step: int):
        """-> (the metrics record of one test set, its translations' path, the hypotheses)."""
        config = self.config
        t_eval = time.monotonic()
        teacher = teacher_forced(ctx.dp, ctx.eval_step, params, self._eval_batches(test, ctx.dp))
        hypotheses = translate_pairs(ctx.model, params, ctx.dp, config, self.tokenizer, test.pairs)
        src_lang, tgt_lang = config.output_languages()
        path = write_translations(
            ctx.workdir,
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
    preset_fields = PRESETS

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
        """The origin's weights (a Marian folder's, checked against its config), else None."""
        return config.origin.initial_params(config.model_config)

    def describe(self, config: TranslateConfig) -> str:
        return config.origin.describe(config.model)

    def prepare(
        self, config: TranslateConfig, workdir: str, dp: DataParallel, log: Callable[[str], None]
    ) -> TranslationData:
        source = translation_source(config)
        source.check(workdir, log)  # a resumed run reads the data it started on
        tokenizer = load_tokenizer(config, workdir, source)
        encoded = source.training_pairs(
            tokenizer, config.cache_dir or os.path.join(workdir, CACHE_DIR), log
        )
        batcher = TokenBatcher(
            encoded,
            tokens_per_batch=config.tokens_per_batch,
            buckets=config.buckets,
            num_devices=dp.n_devices,
            seed=config.seed,
            **special_ids(config.model_config),
        )
        data = TranslationData(
            config=config,
            tokenizer=tokenizer,
            batcher=batcher,
            validation=source.validation_split(tokenizer, log),
            tests=source.test_splits(tokenizer, log),
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
