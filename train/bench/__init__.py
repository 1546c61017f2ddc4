"""Speed benchmarks: training throughput and MFU, decoding against serving engines, XL evaluation.

    python -m train.bench                        # full sizes, for one GPU
    python -m train.bench --quick true           # CPU sizes: a couple of minutes on 2 cores
    python -m train.bench --only train_xl_enwik8,xl_eval --out DIR
    python -m train.bench --only cpu_vs_torch    # the CPU training step against PyTorch
    python -m train.bench --only data            # data preparation and loaders, on the CPU

Flags: one per field of `options.BenchOptions` (`--field VALUE`, as every entry point).
Sections (`--only` picks some; `matmul` runs first, the training sections divide by its rate):
  matmul             the device's achievable matrix rate: median time of a large square
                     product (8192^3 on a GPU) in bf16, and in float32.
  train_transformer  Transformer base (512 wide, 6+6 layers), ~25k source and ~25k target
                     tokens a batch ([768, 32] each, no padding), the paper's vocabulary 37000.
  train_xl_enwik8    Transformer-XL enwik8_base: 12 x 512, segment 512, memory 512, batch 22.
  train_xl_wt103     Transformer-XL wt103_base: 16 x 410, segment/memory 150, adaptive softmax
                     over 267,735 words, batch 60.
  decode             our greedy and beam-4 search against CTranslate2 (float32, int8) and
                     transformers' MarianMTModel on the same random weights (sharpened to
                     decide like a trained model), at the cpu preset's size and an OPUS-MT
                     size (74M parameters): output tokens/s and ms/sentence at batch 1 and 32,
                     load and compile times, agreement with ours; rounds interleaved.
  xl_eval            per-token evaluation time of Transformer-XL with memory (segments of 128,
                     memory = the attention length) against a vanilla Transformer that
                     recomputes a sliding window of the whole attention length for every token
                     (the same network with no memory; only the window's last position is new),
                     at attention lengths 800 ... 3800 (the XL paper's Table 9).
  cpu_vs_torch       (only when asked for) the cpu presets' Transformer (32 x 16 and 64 x 32)
                     and Transformer-XL training steps on the CPU against PyTorch's, eager and
                     `torch.compile`d, same model size, interleaved: see `cpu_vs_torch`.
  data               (only when asked for) preparing 1M synthetic sentence pairs and a 100M-token
                     text (wall time, peak RSS, a reused cache) and the loaders that read their
                     token caches against the CPU step: see `data`.

Every training figure is the project's own train step (`train.core.step.make_train_step` jitted by
`train.core.parallel.DataParallel`: state donated, metrics left on device) on one device, in the
compute dtype (bf16 on an accelerator: parameters, softmax and loss stay float32). Timing:
`.lower(...).compile()` is the compile time; then warm-up steps, then the median of N steps each
ended by `block_until_ready`. FLOPs: the itemized formulas of `train.bench.flops` (stated in the
output), beside XLA's `compiled.cost_analysis()['flops']` and their ratio. MFU = model FLOPs per
second / the bf16 matrix rate measured in the same run (and / the datasheet peak when the device is
known). Peak memory: `compiled.memory_analysis()` (arguments + outputs + temporaries - aliased).
Results go to OUT/bench.json (every raw figure, the device, versions, date, command line) and
OUT/bench.md (tables), and are printed.

One concern per module: config (BenchConfig, its presets, the sections), options (the flags),
timing, profile (trace parsing), train_steps, decode (with engines, the decoders it compares, and
random_models, the weights they decode with), xl_eval, cpu_vs_torch (with torch_reference and
xl_torch_reference, its PyTorch models), data, serve (a trained run in the same engines), report
(json, markdown, merging) and run
(`run_benchmarks`). `__main__` only parses flags and calls `run.run_and_report`; each section is an
importable function that the tests run at tiny sizes.
"""

from train.bench.config import DEFAULT_SECTIONS, SECTIONS, BenchConfig
from train.bench.options import BenchOptions, build_parser, config_from_options, parse_options
from train.bench.run import run_and_report, run_benchmarks

__all__ = [
    "DEFAULT_SECTIONS",
    "SECTIONS",
    "BenchConfig",
    "BenchOptions",
    "build_parser",
    "config_from_options",
    "parse_options",
    "run_and_report",
    "run_benchmarks",
]
