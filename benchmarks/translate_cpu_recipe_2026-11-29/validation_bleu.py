"""Validation BLEU of trained translation runs, at several length penalties: the criterion the
CPU recipe was chosen by (the test set is read only by each run's own final evaluation).

    python benchmarks/translate_cpu_recipe_2026-11-29/validation_bleu.py W1 W2 ... \
        --length_penalty 1.0 1.3 1.6
"""

from __future__ import annotations

import argparse
import json

from train import translate
from train.core.config import replace
from train.core.task import params_for_inference
from train.translate.sources import translation_source
from train.translate.tokenizer import trained_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdirs", nargs="+")
    parser.add_argument("--length_penalty", type=float, nargs="+", default=[1.3])
    args = parser.parse_args()
    for workdir in args.workdirs:
        config, model, params, dp = params_for_inference(translate.TASK, workdir)
        tokenizer = trained_tokenizer(config, workdir)
        split = translation_source(config).validation_split(tokenizer)
        for lp in args.length_penalty:
            run = replace(config, length_penalty=lp)
            hyps = translate.translate_pairs(model, params, dp, run, tokenizer, split.pairs)
            score = translate.bleu(hyps, split.references)
            print(json.dumps({"workdir": workdir, "length_penalty": lp, "val_bleu": score}))


if __name__ == "__main__":
    main()
