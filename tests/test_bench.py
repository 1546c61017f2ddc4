"""train.bench.flops and train.bench: FLOP formulas against the traced program and XLA's count,
the measuring helpers against hand arithmetic, and every benchmark section at tiny sizes.

No figure here is a timing: times are only checked to be used consistently (a rate is the FLOPs
over the median, a throughput the work over the median).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from train.bench import train_steps
from train.bench.config import BenchConfig
from train.bench.decode import decode_section, time_engines
from train.bench.engines import (
    Engine,
    Served,
    Unavailable,
    ctranslate2_engine,
    ours,
    transformers_engine,
    until_eos,
)
from train.bench.flops import (
    jaxpr_matmul_flops,
    transformer_flops,
    xl_flops,
    xla_flops,
)
from train.bench.options import BenchOptions, build_parser, config_from_options, parse_options
from train.bench.profile import hlo_op_kinds, profile_summary, summarize_trace_events
from train.bench.random_models import (
    PiecesTokenizer,
    calibrate_eos,
    opus_mt_config,
    param_shapes,
    random_params,
    random_sources,
    sharpen,
    source_batch,
)
from train.bench.report import to_markdown
from train.bench.run import run_and_report, run_benchmarks
from train.bench.timing import (
    compiled_memory,
    measure_matmul_rate,
    nominal_bf16_peak,
    time_calls,
    utilisation,
)
from train.bench.train_steps import transformer_train_setup, xl_train_setup
from train.core.state import TrainState, count_params
from train.core.step import make_train_step
from train.lm import make_loss_fn as lm_loss_fn
from train.translate import make_loss_fn
from transformer_jax import Transformer, TransformerConfig
from xl_jax import TransformerXL, TransformerXLConfig, init_memory


# ----------------------------------------------------------------------------- helpers
def _transformer_state(cfg: TransformerConfig):
    model = Transformer(cfg)
    dummy = jnp.ones((1, 4), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), dummy, dummy)["params"]
    return model, TrainState.create(params=params, tx=optax.adam(1e-3), rng=jax.random.PRNGKey(1))


def _transformer_batch(cfg, b, s, t, seed=0):
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(3, cfg.tgt_vocab_size, (b, n), dtype=np.int32)  # noqa: E731
    return {"src": ids(s), "tgt_in": ids(t), "tgt_out": ids(t)}


def _xl_state(cfg: TransformerXLConfig, b: int, m: int):
    model = TransformerXL(cfg)
    params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32), init_memory(cfg, 1))[
        "params"
    ]
    return model, TrainState.create(
        params=params,
        tx=optax.adam(1e-3),
        rng=jax.random.PRNGKey(1),
        extra=init_memory(cfg, b, mem_len=m),
    )


def _xl_batch(cfg, b, t, seed=0):
    rng = np.random.default_rng(seed)
    return {
        k: rng.integers(0, cfg.vocab_size, (b, t), dtype=np.int32) for k in ("inputs", "targets")
    }


# ----------------------------------------------------------------------------- the jaxpr counter
def test_jaxpr_counter_counts_products_as_two_multiply_adds():
    a, b = jnp.ones((3, 4)), jnp.ones((4, 5))
    assert jaxpr_matmul_flops(jnp.matmul, a, b) == 2 * 3 * 4 * 5
    x, y = jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5))
    assert (
        jaxpr_matmul_flops(lambda x, y: jnp.einsum("bij,bjk->bik", x, y), x, y) == 2 * 2 * 3 * 4 * 5
    )
    # Elementwise work is not counted.
    assert jaxpr_matmul_flops(lambda a: jnp.exp(a) * 2 + a, a) == 0


def test_jaxpr_counter_enters_scan_jit_and_cond_and_refuses_while():
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    one = 2 * 2 * 4 * 4

    def scanned(x):
        return jax.lax.scan(lambda h, _: (h @ w, None), x, None, length=3)[0]

    assert jaxpr_matmul_flops(scanned, x) == 3 * one
    assert jaxpr_matmul_flops(jax.jit(lambda x: (x @ w) @ w), x) == 2 * one
    # cond: the dearer branch (one product against two).
    assert (
        jaxpr_matmul_flops(
            lambda p, x: jax.lax.cond(p, lambda x: x @ w, lambda x: (x @ w) @ w, x), True, x
        )
        == 2 * one
    )
    with pytest.raises(ValueError, match="while"):
        jaxpr_matmul_flops(
            lambda x: jax.lax.while_loop(
                lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ w), (0, x)
            )[1],
            x,
        )


# ----------------------------------------------------------------------------- formulas
@pytest.mark.parametrize("b,s,t", [(3, 7, 5), (2, 4, 9)])
def test_transformer_formula_equals_the_products_of_the_project_train_step(b, s, t):
    cfg = TransformerConfig.tiny(
        n_encoder_layers=2, n_decoder_layers=1, d_ff=96, src_vocab_size=40, tgt_vocab_size=40
    )
    model, state = _transformer_state(cfg)
    batch = _transformer_batch(cfg, b, s, t)
    count = transformer_flops(cfg, batch=b, src_len=s, tgt_len=t)
    forward = jaxpr_matmul_flops(
        lambda p: model.apply({"params": p}, batch["src"], batch["tgt_in"]), state.params
    )
    assert forward == count.forward(executed=True)
    step = make_train_step(make_loss_fn(model, smoothing=0.1, pad_id=cfg.pad_id))
    assert jaxpr_matmul_flops(step, state, batch) == count.training(executed=True)
    # Nothing is discarded in the Transformer, and training is exactly 3 x forward.
    assert count.training() == count.training(executed=True) == 3 * count.forward()
    assert count.tokens == b * t


XL_CONFIGS = {
    "full softmax": TransformerXLConfig.tiny(),
    "adaptive, div_val 2, projections": TransformerXLConfig.tiny(
        vocab_size=100, cutoffs=(20, 50), div_val=2, d_embed=48, tie_projs=(False, True, False)
    ),
    "clusters, one projected table": TransformerXLConfig.tiny(
        vocab_size=100, cutoffs=(20, 50), d_embed=48
    ),
    "untied, pre-LN": TransformerXLConfig.tiny(
        tie_weights=False, norm_first=True, untie_r=True, n_layers=3
    ),
}


@pytest.mark.parametrize(
    "name,m", [(name, 9) for name in sorted(XL_CONFIGS)] + [("full softmax", 0)]
)
def test_xl_formula_equals_the_products_of_the_project_train_step(name, m):
    # The formula counts every softmax cluster for every token: the dense path. The grouped
    # tails (the default) execute at most that, depending on where the targets fall.
    cfg = XL_CONFIGS[name].replace(softmax_tails="dense")
    b, t = 2, 6
    model, state = _xl_state(cfg, b, m)
    batch = _xl_batch(cfg, b, t)
    count = xl_flops(cfg, batch=b, tgt_len=t, mem_len=m)
    forward = jaxpr_matmul_flops(
        lambda p: model.apply({"params": p}, batch["inputs"], state.extra, batch["targets"]),
        state.params,
    )
    assert forward == count.forward(executed=True)
    step = make_train_step(lm_loss_fn(model))
    assert jaxpr_matmul_flops(step, state, batch) == count.training(executed=True)


XL_REMAT = [f.name for f in dataclasses.fields(TransformerXLConfig)].count("remat") == 1


@pytest.mark.skipif(not XL_REMAT, reason="TransformerXLConfig has no remat field")
@pytest.mark.parametrize("remat", ["none", "attention", "full"])
def test_xl_formula_counts_what_the_backward_pass_recomputes(remat):
    cfg = TransformerXLConfig.tiny(n_layers=2).replace(remat=remat)
    b, t, m = 2, 6, 9
    model, state = _xl_state(cfg, b, m)
    batch = _xl_batch(cfg, b, t)
    count = xl_flops(cfg, batch=b, tgt_len=t, mem_len=m)
    step = make_train_step(lm_loss_fn(model))
    assert jaxpr_matmul_flops(step, state, batch) == count.training(executed=True)
    # Recomputation is executed work, never model FLOPs, and has no forward-pass part.
    plain = xl_flops(cfg.replace(remat="none"), batch=b, tgt_len=t, mem_len=m)
    assert count.training() == plain.training()
    assert count.forward(executed=True) == plain.forward(executed=True)
    hk = cfg.n_heads * cfg.d_head
    attention = cfg.n_layers * 3 * 2.0 * b * t * (m + t) * hk
    extra = count.training(executed=True) - plain.training(executed=True)
    if remat == "attention":
        assert extra == attention
    elif remat == "full":
        layers = plain.forward(executed=True) - xl_flops(
            cfg.replace(n_layers=1, remat="none"), batch=b, tgt_len=t, mem_len=m
        ).forward(executed=True)
        assert extra == 2 * layers  # two layers' worth, one layer's by difference
    else:
        assert extra == 0


def test_xl_model_flops_leave_out_exactly_the_discarded_memory_queries():
    cfg = TransformerXLConfig.tiny(n_layers=3, **({"remat": "none"} if XL_REMAT else {}))
    b, t, m = 2, 6, 9
    count = xl_flops(cfg, batch=b, tgt_len=t, mem_len=m)
    q_rows = 2.0 * b * m * cfg.d_model * cfg.n_heads * cfg.d_head * cfg.n_layers
    assert count.forward(executed=True) - count.forward() == q_rows
    assert count.training(executed=True) - count.training() == 3 * q_rows
    assert (
        xl_flops(cfg, batch=b, tgt_len=t, mem_len=0).forward(executed=True)
        == xl_flops(cfg, batch=b, tgt_len=t, mem_len=0).forward()
    )


def test_xl_formula_for_enwik8_base_by_hand():
    """The paper-sized number, written out once per token: N layers of
    k/v (2 S/T D HK) + q (D HK) + 3 S HK (attention) + HK D + 2 D F, plus D V, times 2 (FLOPs
    per multiply-add) and 3 (training), with R's projection (S D HK per step) trained once."""
    cfg = TransformerXLConfig.enwik8_base()
    b, t, m = 22, 512, 512
    s, d, hk, f, n, v = m + t, 512, 512, 2048, 12, 204
    per_token_macs = n * (2 * s / t * d * hk + d * hk + 3 * s * hk + hk * d + 2 * d * f) + d * v
    r_macs = n * s * d * hk
    expected = 2 * (3 * per_token_macs * b * t + 2 * r_macs)
    count = xl_flops(cfg, batch=b, tgt_len=t, mem_len=m)
    assert math.isclose(count.training(), expected, rel_tol=1e-12)
    assert count.tokens == b * t


def test_xla_count_is_the_formula_plus_a_little_elementwise_work():
    cfg = TransformerConfig.tiny(
        d_model=64,
        d_ff=256,
        n_encoder_layers=1,
        n_decoder_layers=1,
        src_vocab_size=512,
        tgt_vocab_size=512,
    )
    model, state = _transformer_state(cfg)
    batch = _transformer_batch(cfg, 8, 16, 16)
    step = jax.jit(make_train_step(make_loss_fn(model, smoothing=0.1, pad_id=cfg.pad_id)))
    xla = xla_flops(step.lower(state, batch).compile())
    ratio = xla / transformer_flops(cfg, batch=8, src_len=16, tgt_len=16).training(executed=True)
    assert 1.0 <= ratio <= 1.25, ratio


def test_xla_flops_reads_every_form_of_cost_analysis():
    fake = lambda cost: types.SimpleNamespace(cost_analysis=lambda: cost)  # noqa: E731
    assert xla_flops(fake({"flops": 12.0, "bytes accessed": 3.0})) == 12.0
    assert xla_flops(fake([{"flops": 7.0}])) == 7.0  # older jax: one dict per program
    assert xla_flops(fake(None)) is None
    assert xla_flops(fake({})) is None
    assert xla_flops(fake({"flops": -1.0})) is None  # "unknown" on some backends

    def raising():
        raise NotImplementedError

    assert xla_flops(types.SimpleNamespace(cost_analysis=raising)) is None


# ----------------------------------------------------------------------------- measuring helpers
def test_compiled_memory_sums_the_buffers_and_tolerates_missing_analysis():
    stats = types.SimpleNamespace(
        argument_size_in_bytes=100,
        output_size_in_bytes=80,
        temp_size_in_bytes=50,
        alias_size_in_bytes=60,
        generated_code_size_in_bytes=0,
        peak_memory_in_bytes=0,
    )
    mem = compiled_memory(types.SimpleNamespace(memory_analysis=lambda: stats))
    assert mem["footprint"] == 100 + 80 + 50 - 60
    assert "peak_reported" not in mem
    # XLA:TPU: no temporaries reported, the peak holds them: the fit is the peak.
    tpu = types.SimpleNamespace(
        **{**vars(stats), "temp_size_in_bytes": 0, "peak_memory_in_bytes": 500}
    )
    mem = compiled_memory(types.SimpleNamespace(memory_analysis=lambda: tpu))
    assert mem["footprint"] == 500 and mem["peak_reported"] == 500 and mem["temp"] == 0
    # A GPU's peak at or below its buffers' sum leaves the sum.
    gpu = types.SimpleNamespace(**{**vars(stats), "peak_memory_in_bytes": 150})
    assert compiled_memory(types.SimpleNamespace(memory_analysis=lambda: gpu))["footprint"] == 170
    assert compiled_memory(types.SimpleNamespace(memory_analysis=lambda: None)) is None
    # A real compiled donating program: the donated argument aliases the output.
    f = jax.jit(lambda x: x * 2, donate_argnums=0)
    mem = compiled_memory(f.lower(jnp.ones((256,), jnp.float32)).compile())
    assert mem["argument"] == mem["output"] == mem["alias"] == 1024


def test_matmul_rate_is_two_n_cubed_over_the_median_time():
    r = measure_matmul_rate(32, "float32", repeats=3, warmup=1)
    assert len(r["times_s"]) == 3
    assert r["median_s"] == statistics.median(r["times_s"])
    assert r["rate"] == 2 * 32**3 / r["median_s"]


def test_time_calls_warms_up_then_times_each_call():
    calls = []
    times = time_calls(lambda: calls.append(1) or jnp.zeros(()), warmup=2, repeats=3)
    assert len(calls) == 5 and len(times) == 3 and all(x >= 0 for x in times)


def test_nominal_peak_tells_the_h100_variants_apart():
    assert nominal_bf16_peak("NVIDIA H100 80GB HBM3") == 989.4e12
    assert nominal_bf16_peak("NVIDIA H100 PCIe") == 756e12
    assert nominal_bf16_peak("NVIDIA H200") == 989.4e12
    assert nominal_bf16_peak("cpu") is None
    assert utilisation(50.0, 2.0, 100.0) == 0.25
    assert utilisation(50.0, 2.0, None) is None


def _meta_events(pid, process, threads):
    events = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": process}}]
    events += [
        {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": n}}
        for tid, n in threads.items()
    ]
    return events


def _op(pid, tid, name, dur, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": 0, "dur": dur, "args": args}


def test_trace_summary_reads_the_xla_ops_line_of_the_device():
    events = _meta_events(
        1, "/device:GPU:0", {10: "Stream #7(Compute)", 11: "XLA Ops"}
    ) + _meta_events(2, "/host:CPU", {20: "python"})
    events += [
        _op(
            1,
            11,
            "fusion.1",
            20.0,
            long_name="%fusion.1 = f32[8] fusion(%dot.3), kind=kLoop, calls=%fused_add",
        ),
        _op(1, 11, "fusion.1", 20.0),
        _op(
            1,
            11,
            "custom-call.2",
            60.0,
            long_name="%custom-call.2 = bf16[8,8] custom-call(%a, %b), "
            'custom_call_target="__cublas$gemm"',
        ),
        _op(
            1,
            11,
            "custom-call.3",
            20.0,
            long_name="%custom-call.3 = bf16[8,8] custom-call(%q, %k, %v), "
            'custom_call_target="__cudnn$fmhaSoftmax"',
        ),
        _op(1, 10, "sm90_kernel_ignored_when_xla_ops_exist", 500.0),
        _op(2, 20, "PjitFunction(step)", 900.0),  # host side: not device time
    ]
    summary = summarize_trace_events(events, steps=2)
    assert summary["source"] == "device: XLA Ops"
    assert summary["busy_us_per_step"] == (20 + 20 + 60 + 20) / 2
    assert [
        (op["name"], op["us_per_step"], op["calls_per_step"], op["category"])
        for op in summary["top"]
    ] == [
        ("custom-call.2", 30.0, 0.5, "matmul"),
        ("fusion.1", 20.0, 1.0, "other (elementwise, reductions)"),  # reads a dot: no matmul
        ("custom-call.3", 10.0, 0.5, "attention (fused)"),
    ]
    assert summary["categories"] == pytest.approx(
        {"matmul": 0.5, "other (elementwise, reductions)": 1 / 3, "attention (fused)": 1 / 6}
    )


def test_trace_summary_falls_back_to_streams_then_to_host_threads():
    gpu = _meta_events(1, "/device:GPU:0", {10: "Stream #7(Compute)", 12: "Stream #8(Copy)"})
    gpu += [
        _op(1, 10, "sm90_xmma_gemm_bf16", 20.0),
        _op(1, 12, "memcpy_d2d", 10.0),
        # cuBLAS's nvjet GEMM kernels (jax 0.11, H100) are matrix products too.
        _op(1, 10, "nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", 10.0),
    ]
    summary = summarize_trace_events(gpu, steps=1)
    assert summary["source"] == "device: streams"
    assert summary["categories"] == pytest.approx({"matmul": 0.75, "copy": 0.25})
    cpu = _meta_events(5, "/host:CPU", {1: "python", 2: "tf_XLAEigen/1"})
    cpu += [
        _op(5, 1, "$bench.py:10 one_step", 99.0),
        _op(5, 2, "ThunkExecutor::Execute", 50.0),
        _op(5, 2, "dot.4", 8.0),
        _op(5, 2, "fusion.2", 2.0),
    ]
    summary = summarize_trace_events(cpu, steps=1)
    assert summary["source"].startswith("host threads")
    assert [op["name"] for op in summary["top"]] == ["dot.4", "fusion.2"]
    assert summarize_trace_events(_meta_events(1, "/host:CPU", {}), steps=1) is None


CPU_HLO = """HloModule jit_step, entry_computation_layout={(f32[8,4]{1,0})->f32[8,8]{1,0}}

%fused_computation.3 (param_0: f32[8,4], param_1: f32[8,4]) -> f32[8,8] {
  %param_0 = f32[8,4]{1,0} parameter(0)
  %param_1 = f32[8,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,8]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}
}

%fused_computation.4 (param_0.1: f32[8,8]) -> f32[8,8] {
  %param_0.1 = f32[8,8]{1,0} parameter(0)
  ROOT %tanh.1 = f32[8,8]{1,0} tanh(%param_0.1)
}

ENTRY %main.9 (x: f32[8,4]) -> f32[8,8] {
  %x = f32[8,4]{1,0} parameter(0)
  %ynn_fusion.3 = f32[8,8]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_computation.3
  ROOT %tanh_fusion = f32[8,8]{1,0} fusion(%ynn_fusion.3), kind=kLoop, calls=%fused_computation.4
}
"""


def test_trace_summary_reads_what_a_cpu_library_fusion_runs_from_the_hlo():
    """XLA:CPU's YNNPACK fusions hold the matrix products; the trace names only the fusion."""
    kinds = hlo_op_kinds(CPU_HLO)
    assert kinds["ynn_fusion.3"] == "fusion dot"
    assert kinds["tanh_fusion"] == "fusion tanh"
    cpu = _meta_events(5, "/host:CPU", {2: "tf_XLAEigen/1"})
    cpu += [_op(5, 2, "ynn_fusion.3", 6.0), _op(5, 2, "tanh_fusion", 2.0)]
    assert summarize_trace_events(cpu, steps=1)["categories"] == {
        "other (elementwise, reductions)": 1.0
    }
    summary = summarize_trace_events(cpu, steps=1, hlo_text=CPU_HLO)
    assert summary["categories"] == {"matmul": 0.75, "other (elementwise, reductions)": 0.25}


def _region(pid, tid, start, stop):
    mark = "ThreadpoolListener::{}Region"
    return [
        {"ph": "X", "pid": pid, "tid": tid, "name": mark.format(k), "ts": t, "dur": 0}
        for k, t in (("Start", start), ("Stop", stop))
    ]


def test_trace_summary_counts_the_cpu_pools_work_outside_op_events():
    """A YNNPACK product's helper threads and an Eigen contraction's tasks are pool work with no
    op event on their thread: credited to the op that runs meanwhile, else left unattributed."""
    cpu = _meta_events(
        5, "/host:CPU", {1: "python", 2: "tf_XLAEigen/1", 3: "tf_XLAEigen/2", 4: "tf_XLAPjRt/1"}
    )
    at = lambda e, ts: {**e, "ts": ts}  # noqa: E731
    cpu += [
        at(_op(5, 2, "dot.4", 10.0), 0),  # returns at once; its tasks run to t = 40 on both
        at(_op(5, 2, "ynn_fusion.3", 40.0), 40),  # thread 3 helps it throughout
        at(_op(5, 3, "tanh_fusion", 10.0), 80),  # thread 2 idle: no help
        *_region(5, 2, 0, 80),
        *_region(5, 3, 0, 90),
        *_region(5, 4, 0, 90),  # the client thread waiting for the program: not pool work
    ]
    summary = summarize_trace_events(cpu, steps=1, hlo_text=CPU_HLO)
    assert summary["op_events_us_per_step"] == 10 + 40 + 10
    # Thread 3 helps dot.4 while its event lasts (10) and the product throughout (40); from
    # t = 10 to 40 both threads run dot.4's tasks with no op event anywhere (2 x 30).
    assert summary["busy_us_per_step"] == 80 + 90
    ops = {op["name"]: op["us_per_step"] for op in summary["top"]}
    assert ops == {
        "ynn_fusion.3": 80.0,
        "(pool work while no op event runs)": 60.0,
        "dot.4": 20.0,
        "tanh_fusion": 10.0,
    }
    assert summary["categories"] == pytest.approx(
        {
            "matmul": 100 / 170,
            "pool work, no op (asynchronous library calls)": 60 / 170,
            "other (elementwise, reductions)": 10 / 170,
        }
    )
    assert summary["source"].endswith("with the pool's work outside op events")


def test_a_profiled_cpu_program_counts_its_matrix_product_as_one(tmp_path):
    """On the real compiler and profiler: the trace's op names are the HLO's, so the op that
    runs the product (a YNNPACK fusion with jax 0.10, a dot elsewhere) is counted as matmul."""
    a, b = jnp.ones((256, 128)), jnp.ones((128, 256))
    compiled = jax.jit(lambda a, b: jnp.tanh(a @ b)).lower(a, b).compile()
    jax.block_until_ready(compiled(a, b))
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(3):
            jax.block_until_ready(compiled(a, b))
    summary = profile_summary(str(tmp_path), steps=3, hlo_text=compiled.as_text())
    assert summary is not None
    assert summary["categories"].get("matmul", 0) > 0, summary


# ----------------------------------------------------------------------------- the sections
def _tiny_bench_config() -> BenchConfig:
    xl = dict(n_layers=1, n_heads=2, d_model=32, d_head=16, d_inner=64)
    return BenchConfig.quick().replace(
        steps=2,
        warmup=1,
        matmul_size=64,
        matmul_repeats=2,
        transformer=TransformerConfig.tiny(n_encoder_layers=1, n_decoder_layers=1),
        transformer_batch=4,
        transformer_len=8,
        xl=(
            ("enwik8_base (tiny)", TransformerXLConfig.enwik8_base(tgt_len=8, mem_len=8, **xl), 2),
        ),
        xl_eval=TransformerXLConfig.enwik8_base(dropout=0.0, **xl),
        attn_lengths=(8, 16),
        xl_eval_tgt_len=4,
        xl_eval_batch=2,
        vanilla_batch=2,
        eval_repeats=2,
    )


def test_padded_transformer_rows_count_only_their_real_tokens():
    config = _tiny_bench_config()
    full = transformer_train_setup(config)
    assert full.real_tokens == 4 * 8 and full.flops.tokens == 4 * 8
    assert not any((v == config.transformer.pad_id).any() for v in full.batch.values())
    bench = transformer_train_setup(config.replace(transformer_min_len=3))
    pad = config.transformer.pad_id
    assert bench.flops.tokens == 4 * 8  # the padded positions still cost their FLOPs
    assert bench.real_tokens == int((bench.batch["tgt_out"] != pad).sum()) < 4 * 8
    for name, rows in bench.batch.items():
        real = rows != pad
        lengths = real.sum(axis=1)
        assert lengths.min() >= 3, name
        # Each row: its real tokens first, then only padding.
        np.testing.assert_array_equal(real, np.arange(8) < lengths[:, None], err_msg=name)
    np.testing.assert_array_equal(bench.batch["tgt_in"] != pad, bench.batch["tgt_out"] != pad)
    with pytest.raises(ValueError, match="transformer_min_len"):
        config.replace(transformer_min_len=9)


def test_xl_attention_impl_and_row_lengths_reach_the_bench_config():
    config = config_from_options(
        parse_options(["--xl_attention_impl", "pallas", "--transformer_min_len", "5"])
    )
    assert {c.attention_impl for _, c, _ in config.xl} == {"pallas"}
    assert config.xl_eval.attention_impl == "pallas"
    assert config.transformer.attention_impl == "auto"  # the kernels are Transformer-XL's
    assert config.transformer_min_len == 5
    with pytest.raises(SystemExit):
        parse_options(["--attention_impl", "pallas"])  # not an option of every model


@pytest.mark.slow
def test_run_writes_every_training_figure_and_the_xl_eval_table(tmp_path):
    config = _tiny_bench_config().replace(transformer_min_len=3)
    results = run_benchmarks(
        config,
        sections=("train_transformer", "train_xl_enwik8", "xl_eval"),
        out=str(tmp_path),
        command="python -m train.bench --test",
        raise_errors=True,
        log=lambda m: None,
    )
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["meta"]["command"] == "python -m train.bench --test"
    assert saved["meta"]["jax"] == jax.__version__
    assert set(saved["matmul"]) == {"bfloat16", "float32"}
    assert [r["name"] for r in saved["train"]] == ["transformer (quick)", "enwik8_base (tiny)"]
    rates = {k: v["rate"] for k, v in saved["matmul"].items()}
    for r in saved["train"]:
        assert math.isfinite(r["final_loss"])
        assert r["step_s_median"] == statistics.median(r["step_times_s"])
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_s_median"])
        # The traced program holds exactly the formula's products (CPU: no fused kernel).
        assert r["jaxpr_matmul_flops"] == r["flops"]["executed_training"]
        if not r["xla_counts_loops_once"]:  # (XL's layer scan: XLA counts its body once)
            assert r["xla_flops"] >= r["flops"]["executed_training"]
        assert r["mfu_vs_measured_bf16"] == pytest.approx(
            r["flops"]["model_training"] / r["step_s_median"] / rates["bfloat16"]
        )
        assert r["mfu_vs_nominal_bf16"] is None  # a CPU has no datasheet entry
        assert r["memory"]["footprint"] > 0
        # Profiled from a real trace of 3 more steps: the category shares add up to 1.
        assert r["profile"]["busy_us_per_step"] > 0
        assert sum(r["profile"]["categories"].values()) == pytest.approx(1.0)
    assert saved["train"][0]["tokens_per_step"] == 4 * 8
    assert saved["train"][1]["tokens_per_step"] == 2 * 8
    # Real tokens: the Transformer's padded rows count less; the XL stream has no padding.
    transformer, xl = saved["train"]
    assert transformer["real_tokens_per_step"] == transformer_train_setup(config).real_tokens
    assert transformer["real_tokens_per_step"] < transformer["tokens_per_step"]
    assert xl["real_tokens_per_step"] == xl["tokens_per_step"]
    for r in saved["train"]:
        share = r["real_tokens_per_step"] / r["tokens_per_step"]
        assert r["real_tokens_per_s"] == pytest.approx(r["tokens_per_s"] * share)
        assert r["real_mfu_vs_measured_bf16"] == pytest.approx(r["mfu_vs_measured_bf16"] * share)
    report = (tmp_path / "bench.md").read_text()
    assert f"{transformer['real_tokens_per_step']:,} of 32 positions a step" in report
    assert [r["attn_len"] for r in saved["xl_eval"]] == [8, 16]
    for r in saved["xl_eval"]:
        assert r["speedup"] == pytest.approx(r["vanilla_s_per_token"] / r["xl_s_per_token"])
        assert r["flop_ratio"] == pytest.approx(
            r["vanilla_flops_per_token"] / r["xl_flops_per_token"]
        )
    md = (tmp_path / "bench.md").read_text()
    assert "| transformer (quick) | 32 |" in md and "| enwik8_base (tiny) | 16 |" in md
    assert "training FLOPs = 3 x forward" in md and "Profile of enwik8_base (tiny)" in md
    assert md.count("\n| 8 |") == 1 and md.count("\n| 16 |") == 1
    assert results["errors"] == []


@pytest.mark.parametrize("which", ["transformer", "enwik8_base", "wt103_base"])
def test_full_size_train_steps_trace_and_hold_exactly_the_formulas_products(which):
    """The paper sizes of `python -m train.bench` (one GPU), traced without allocating: the
    project's train step runs at these shapes, and the formula counts its every product."""
    config = BenchConfig.full()
    if which == "transformer":
        setup = transformer_train_setup(config)
    else:
        name, xl_cfg, b = next(x for x in config.xl if x[0] == which)
        setup = xl_train_setup(name, xl_cfg, b, config)
    state = jax.eval_shape(setup.init_state)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in setup.batch.items()}
    step = make_train_step(setup.loss_fn)
    new_state, metrics = jax.eval_shape(step, state, batch)
    chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
    assert jaxpr_matmul_flops(step, state, batch) == setup.flops.training(executed=True)
    # Known sizes: 768 x 32 target tokens; 22 x 512; 60 x 150.
    assert (
        setup.flops.tokens
        == {"transformer": 24_576, "enwik8_base": 11_264, "wt103_base": 9_000}[which]
    )


@pytest.mark.slow
def test_a_failing_section_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(train_steps, "transformer_train_setup", broken)
    config = _tiny_bench_config().replace(attn_lengths=(8,))
    results = run_benchmarks(
        config,
        sections=("train_transformer", "xl_eval"),
        out=str(tmp_path),
        profile=False,
        log=lambda m: None,
    )
    assert [e["section"] for e in results["errors"]] == ["train_transformer"]
    assert "out of memory (simulated)" in (tmp_path / "bench.md").read_text()
    assert len(results["xl_eval"]) == 1

    # A second command re-runs the failed section and merges into the same file.
    monkeypatch.undo()
    run_benchmarks(
        config,
        sections=("train_transformer",),
        out=str(tmp_path),
        profile=False,
        append=True,
        command="second",
        log=lambda m: None,
    )
    merged = json.loads((tmp_path / "bench.json").read_text())
    assert merged["errors"] == []
    assert [r["name"] for r in merged["train"]] == ["transformer (quick)"]
    assert merged["xl_eval"] == json.loads(json.dumps(results["xl_eval"]))  # kept
    assert merged["meta"]["command"] == "second"
    assert [r["command"] for r in merged["meta"]["earlier_runs"]] == [""]
    assert "Earlier, merged" in (tmp_path / "bench.md").read_text()


# ----------------------------------------------------------------------------- decoding
def _tiny_marian(**overrides) -> TransformerConfig:
    """A tiny model every engine takes (Marian's options: post-LN, sines then cosines, epsilon
    1e-5, swish), of realistic sources' lengths."""
    fields = dict(
        src_vocab_size=50,
        tgt_vocab_size=50,
        d_model=32,
        n_heads=4,
        d_ff=64,
        n_encoder_layers=2,
        n_decoder_layers=2,
        positional="sinusoidal_concat",
        layer_norm_eps=1e-5,
        activation="swish",
        max_len=64,
    )
    return TransformerConfig.tiny(**{**fields, **overrides})


def _decode_config(**changes) -> BenchConfig:
    # One bucket and two batch sizes: our search compiles 4 programs (2 shapes x 2 searches).
    # One thread each: on a busy 2-core machine two threads wait on each other.
    return BenchConfig.quick().replace(
        **{
            "decode_sizes": (("tiny", _tiny_marian()),),
            "decode_batches": (1, 3),
            "decode_sentences": 6,
            "decode_latency_sentences": 2,
            "decode_rounds": 1,
            "decode_buckets": (32,),
            "decode_threads": 1,
            **changes,
        }
    )


@pytest.fixture(scope="module")
def decode_results(tmp_path_factory):
    pytest.importorskip("ctranslate2")
    pytest.importorskip("transformers")
    cache = tmp_path_factory.mktemp("bench-cache")
    return decode_section(_decode_config(), cache_dir=str(cache), log=lambda m: None), cache


@pytest.mark.slow
def test_decode_section_runs_every_engine_on_every_batch_and_search(decode_results):
    result, cache = decode_results
    assert result["backend"] == "cpu" and result["engine_device"] == "cpu"
    (size,) = result["sizes"]
    assert size["unavailable"] == {}
    engines = ["ours", "ours int8", "ctranslate2 float32", "ctranslate2 int8", "transformers"]
    assert list(size["engines"]) == engines
    # Exported into the run's cache folder: a CTranslate2 folder each, a Hugging Face one.
    for folder in ("ct2-float32", "ct2-int8"):
        assert (cache / "decode" / "tiny" / folder / "model.bin").is_file()
    assert (cache / "decode" / "tiny" / "marian" / "model.safetensors").is_file()
    assert size["params"] == count_params(param_shapes(_tiny_marian()))
    keys = [(r["batch"], r["search"], r["engine"]) for r in size["rows"]]
    assert keys == [(b, s, e) for b in (1, 3) for s in ("greedy", "beam") for e in engines]
    for r in size["rows"]:
        n = 2 if r["batch"] == 1 else 6
        assert r["sentences"] == n and len(r["pass_times_s"]) == 1
        assert r["pass_s_median"] == statistics.median(r["pass_times_s"])
        assert r["tokens_per_s"] == pytest.approx(r["output_tokens"] / r["pass_s_median"])
        assert r["ms_per_sentence"] == pytest.approx(1e3 * r["pass_s_median"] / n)
        assert r["lengths"]["mean"] == pytest.approx(r["output_tokens"] / n)
        # Batch 1: a shape per sentence's bucket; batch 3: two batches of 3 (sorted).
        assert r["shapes"] == ([(1, 32)] if r["batch"] == 1 else [(3, 32)])
        assert set(r["first_calls_extra_s_by_shape"]) == {f"{r['batch']}x32"}
    for r in size["rows"]:
        if r["engine"] == "ours":
            assert r["x_ours"] == 1.0 and r["same_as_ours"] == 1.0
    json.dumps(result)  # bench.json takes it as it is


@pytest.mark.slow
def test_decode_section_greedy_agrees_with_ctranslate2_and_outputs_vary(decode_results):
    """The sharpened random model decides: CTranslate2 float32 finds our greedy tokens for
    every sentence (as it does on trained models), and the outputs end at varied lengths."""
    (size,) = decode_results[0]["sizes"]
    ct2 = [
        r for r in size["rows"] if r["engine"] == "ctranslate2 float32" and r["search"] == "greedy"
    ]
    assert [r["same_as_ours"] for r in ct2] == [1.0, 1.0]
    lengths = size["greedy_lengths"]
    assert lengths["min"] < lengths["max"] and lengths["at_limit"] < 0.5
    assert size["eos_calibration"]["eos_bias"] >= 0


@pytest.mark.slow
def test_decode_section_markdown_lists_every_row_and_the_notes(decode_results):
    result = dict(decode_results[0])
    size = dict(result["sizes"][0], unavailable={"transformers": "cannot export to Marian"})
    result["sizes"] = [size]
    md = to_markdown({"meta": _meta_for_markdown(), "train": [], "errors": [], "decode": result})
    assert "| model | batch | search | engine | output tokens/s |" in md
    for engine in ("ours", "ours int8", "ctranslate2 float32", "ctranslate2 int8", "transformers"):
        assert md.count(f"| tiny | 1 | greedy | {engine} |") == 1
        assert md.count(f"| tiny | 3 | beam | {engine} |") == 1
    assert "tiny: transformers unavailable: cannot export to Marian" in md
    assert f"{size['params']:,} parameters" in md


def _meta_for_markdown() -> dict:
    return {
        "device_kind": "cpu",
        "platform": "cpu",
        "jax": jax.__version__,
        "dtype": "float32",
        "date": "today",
        "command": "python -m train.bench --only decode",
    }


def test_old_decode_results_still_render():
    old = {
        "model": "Transformer 6+6 x 512, V 8000",
        "weights": "random init",
        "split": "test_2016_flickr",
        "sentences_per_s": 12.5,
        "output_tokens_per_s": 300.0,
    }
    md = to_markdown({"meta": _meta_for_markdown(), "train": [], "errors": [], "decode": old})
    assert "12.5 sentences/s" in md


def test_time_engines_counts_tokens_to_eos_and_compares_with_the_first_engine():
    """Fake engines (no model): the figures come from their outputs and the pass times."""
    eos, pad = 2, 0
    batches = [
        {"src": np.array([[5, 2, 0, 0], [6, 7, 2, 0]], np.int32), "index": np.array([1, 0])},
        {"src": np.array([[8, 2]], np.int32), "index": np.array([2])},
    ]
    calls = []

    def fake(shift):
        def decode(src, *, greedy, max_len):
            calls.append((src.shape, greedy, max_len))
            out = np.full((len(src), max_len), pad, np.int32)
            for row, s in enumerate(src):
                n = int(s[0]) - 4 + shift  # sentence-dependent length
                out[row, :n] = 9
                if n < max_len:  # else: no room for EOS, the output is cut at the limit
                    out[row, n] = eos
            return out

        return Engine(decode)

    rows = time_engines(
        {"ours": fake(0), "other": fake(1)},
        batches,
        n=3,
        greedy=True,
        margin=3,
        rounds=2,
        eos=eos,
        pad=pad,
        labels={"batch": 2, "search": "greedy"},
    )
    # Every engine decodes every batch in 1 + 2 rounds, output positions L + margin.
    assert calls.count(((2, 4), True, 7)) == 6 and calls.count(((1, 2), True, 5)) == 6
    ours, other = rows
    # Sentences 0, 1, 2 read 6, 5, 8: ours emits 2, 1, 4 tokens then EOS; the other one
    # token more, which for sentence 2 fills its 5 positions: no EOS.
    assert ours["output_tokens"] == 3 + 2 + 5 and other["output_tokens"] == 4 + 3 + 5
    assert ours["lengths"] == {"mean": 10 / 3, "min": 2, "max": 5, "at_limit": 0.0}
    assert other["lengths"]["at_limit"] == 1 / 3
    assert ours["same_as_ours"] == 1.0 and other["same_as_ours"] == 0.0
    assert other["x_ours"] == pytest.approx(other["tokens_per_s"] / ours["tokens_per_s"])
    assert ours["batch"] == 2 and ours["shapes"] == [(1, 2), (2, 4)]
    assert set(ours["first_calls_extra_s_by_shape"]) == {"2x4", "1x2"}
    assert len(ours["pass_times_s"]) == 2


def test_until_eos_keeps_the_eos_and_drops_pad():
    assert until_eos(np.array([5, 6, 2, 0, 0]), eos=2, pad=0) == [5, 6, 2]
    assert until_eos(np.array([5, 6, 7]), eos=2, pad=0) == [5, 6, 7]


def test_random_models_keep_shapes_and_make_ids_the_exporters_take():
    cfg = _tiny_marian()
    params = random_params(cfg, seed=0)
    chex.assert_trees_all_equal_shapes(params, param_shapes(cfg))
    sharp = sharpen(cfg, params)
    chex.assert_trees_all_equal_shapes(sharp, params)
    # The last LayerNorm (post-LN: the last decoder layer's) scales the logits.
    norm = sharp["decoder"]["layers_1"]["ffn_residual"]["norm"]["scale"]
    assert float(norm[0]) > 1.0
    sources = random_sources(cfg, n=20, lengths=(8, 12), seed=0)
    assert sources == random_sources(cfg, n=20, lengths=(8, 12), seed=0)
    assert {len(s) for s in sources} <= set(range(8, 13)) and len({len(s) for s in sources}) > 1
    tokenizer = PiecesTokenizer(cfg)
    specials = {cfg.pad_id, cfg.bos_id, tokenizer.unk_id}
    assert all(s[-1] == cfg.eos_id and not specials & set(s[:-1]) for s in sources)
    assert [tokenizer.id_to_piece(i) for i in range(5)] == ["<pad>", "<s>", "</s>", "<unk>", "▁w4"]
    # OPUS-MT's ids: EOS 0, <unk> 1, pad (= bos) last; 73,944,309 parameters.
    opus = opus_mt_config()
    opus_tokenizer = PiecesTokenizer(opus)
    assert [opus_tokenizer.id_to_piece(i) for i in (0, 1, 58100)] == ["</s>", "<unk>", "<pad>"]
    assert count_params(param_shapes(opus)) == 73_944_309


def test_calibrated_eos_bias_brings_outputs_near_the_target_length():
    cfg = _tiny_marian()
    params = sharpen(cfg, random_params(cfg, seed=0))
    src = source_batch(random_sources(cfg, n=8, lengths=(8, 30), seed=0), cfg.pad_id, 32)
    _, info = calibrate_eos(cfg, params, src, max_len=40, target=12.0)
    assert info["target"] == 12.0 and info["eos_bias"] > 0
    assert abs(info["mean_length"] - 12.0) < 6.0


def test_engines_that_cannot_run_say_why(monkeypatch, tmp_path):
    pre_ln = _tiny_marian(norm_first=True)
    served = Served(pre_ln, {}, PiecesTokenizer(pre_ln), folder=str(tmp_path))
    with pytest.raises(Unavailable, match="norm_first=True"):
        transformers_engine(served)
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # not installed
    with pytest.raises(Unavailable, match="ctranslate2 is not installed"):
        ctranslate2_engine(served, quantization="float32")
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.slow
def test_an_unavailable_engine_is_reported_and_the_others_run(tmp_path):
    def missing(served):
        raise Unavailable("not installed here")

    config = _decode_config(decode_batches=(2,), decode_sentences=2)
    result = decode_section(
        config,
        cache_dir=str(tmp_path),
        engines=(("ours", ours), ("future int8", missing)),
        log=lambda m: None,
    )
    (size,) = result["sizes"]
    assert size["unavailable"] == {"future int8": "not installed here"}
    assert {r["engine"] for r in size["rows"]} == {"ours"}


# ----------------------------------------------------------------------------- CLI
def test_cli_sizes_and_batch_overrides():
    config = config_from_options(
        parse_options(["--batch", "wt103=8,transformer=64", "--steps", "7"])
    )
    assert dict((n.split("_")[0], b) for n, _, b in config.xl) == {"enwik8": 22, "wt103": 8}
    assert config.transformer_batch == 64 and config.steps == 7
    assert config.dtype == "float32"  # auto on a CPU
    full = BenchConfig.full()
    assert (
        full.transformer.d_model,
        full.transformer.n_encoder_layers,
        full.transformer.n_decoder_layers,
    ) == (512, 6, 6)
    assert full.transformer_batch * full.transformer_len == 24_576
    enwik8 = dict((n, (c, b)) for n, c, b in full.xl)["enwik8_base"]
    assert (
        enwik8[0].n_layers,
        enwik8[0].d_model,
        enwik8[0].tgt_len,
        enwik8[0].mem_len,
        enwik8[1],
    ) == (12, 512, 512, 512, 22)
    assert full.attn_lengths[0] == 800 and full.attn_lengths[-1] == 3800
    assert full.beam_size == 4
    with pytest.raises(ValueError, match="unknown bench"):
        config_from_options(parse_options(["--batch", "gpt=8"]))
    with pytest.raises(ValueError, match="dtype"):
        BenchConfig.quick("float16")


def test_decode_options_pick_sizes_rounds_and_threads():
    options = ["--quick", "true", "--decode_sizes", "opus", "--decode_rounds", "4"]
    config = config_from_options(parse_options([*options, "--decode_threads", "1"]))
    assert [name for name, _ in config.decode_sizes] == ["opus-mt"]
    assert config.decode_rounds == 4 and config.decode_threads == 1
    impl = config_from_options(parse_options(["--attention_impl", "xla"]))
    assert {c.attention_impl for _, c in impl.decode_sizes} == {"xla"}
    for preset in (BenchConfig.full(), BenchConfig.quick()):
        sizes = dict(preset.decode_sizes)
        assert list(sizes) == ["cpu", "opus-mt"]
        # The cpu preset's translation model (pre-LN) and an OPUS-MT-sized Marian one.
        assert sizes["cpu"] == BenchConfig.full().torch_transformer.replace(
            dropout=sizes["cpu"].dropout, attention_dropout=sizes["cpu"].attention_dropout
        )
        assert sizes["cpu"].norm_first and not sizes["opus-mt"].norm_first
        assert preset.decode_batches == (1, 32) and preset.decode_threads == 2
    with pytest.raises(ValueError, match="decode_sizes: unknown"):
        config_from_options(parse_options(["--decode_sizes", "gpt"]))
    with pytest.raises(ValueError, match="decode_source_lengths"):
        BenchConfig.quick().replace(decode_source_lengths=(1, 5))


def test_main_quick_matmul_only_writes_both_files(tmp_path, capsys):
    # What `python -m train.bench --quick true --only matmul --out DIR` does.
    command = f"python -m train.bench --quick true --only matmul --out {tmp_path}"
    options = parse_options(command.split()[3:])
    assert run_and_report(options, command=command) == 0
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["meta"]["quick"] is True
    assert saved["meta"]["command"] == command
    assert "Measured matrix rate" in capsys.readouterr().out
    chex.assert_trees_all_equal(saved["train"], [])


def test_every_option_is_a_flag_in_the_entry_points_style():
    flags = {s for a in build_parser()._actions for s in a.option_strings}
    assert {f"--{f.name}" for f in dataclasses.fields(BenchOptions)} <= flags
    options = parse_options(
        [
            "--only",
            "train_transformer,train_xl_enwik8",
            "--quick",
            "true",
            "--attention_impl",
            "xla",
            "--xl_remat",
            "none",
            "--profile",
            "false",
            "--torch_compile",
            "false",
        ]
    )
    assert options.only == ("train_transformer", "train_xl_enwik8")
    assert options.quick and not options.profile
    config = config_from_options(options)
    assert config.transformer.attention_impl == "xla" and config.torch_compile is False
    assert {c.remat for _, c, _ in config.xl} == {"none"} and config.torch_xl.remat == "none"
    assert "cpu_vs_torch" not in parse_options([]).only  # opt-in: it times the CPU
    for bad in (["--only", "gpt"], ["--xl_remat", "some"], ["--attention-impl", "xla"]):
        with pytest.raises(SystemExit):
            parse_options(bad)


# ----------------------------------------------------------------------------- CPU vs PyTorch
def test_hlo_products_counts_every_dot_and_its_flops_fused_or_not():
    """`products_floor.hlo_products` reads the products of an optimized HLO module: a plain
    and a batched product, 2 x output elements x contracted size each."""
    from train.bench.products_floor import hlo_products

    def f(a, b, c, d):
        return jnp.tanh(a @ b), jnp.einsum("bij,bjk->bik", c, d) * 2.0

    args = [jnp.ones(s, jnp.float32) for s in ((8, 16), (16, 4), (2, 3, 5), (2, 5, 7))]
    hlo = jax.jit(f).lower(*args).compile().as_text()
    assert hlo_products(hlo) == (2, pytest.approx((2 * 8 * 4 * 16 + 2 * 2 * 3 * 7 * 5) / 1e9))
    assert hlo_products("HloModule m\n") == (0, 0.0)


def test_the_floor_table_says_when_the_floor_and_the_step_have_different_products():
    from train.bench.report import _floor_lines

    def row(name, step, floor):
        arm = {"median_s": 0.01}
        return {
            "name": name,
            "products": {"step": step, "floor": floor},
            "arms": {"jax_floor": arm, "torch_floor": arm},
            "eager_over_floor": 1.2,
            "project_above_floor_ms": 1.0,
            "eager_above_floor_ms": 2.0,
        }

    same = _floor_lines([row("A", [10, 1.5], [10, 1.5])])
    assert any(line.startswith("| A | 10, 1.5; 10, 1.5 |") for line in same)
    assert not any("products differ" in line for line in same)
    differ = _floor_lines([row("A", [10, 1.5], [10, 1.5]), row("B", [12, 1.7], [10, 1.5])])
    notes = [line for line in differ if "products differ" in line]
    assert len(notes) == 1 and notes[0].startswith("- B:")
    assert _floor_lines([{"name": "C", "floor_error": "not mirrored"}]) == []


def test_products_floor_refuses_a_model_it_does_not_mirror():
    from train.bench.products_floor import transformer_floor, xl_floor

    with pytest.raises(ValueError, match="cutoffs"):
        xl_floor(TransformerXLConfig.tiny(cutoffs=(20,)), 2)
    with pytest.raises(ValueError, match="int8"):
        transformer_floor(TransformerConfig.tiny(quantize="int8"), 2, 8)
    # The comparison then runs without it and says why.
    from train.bench.cpu_vs_torch import build_floor

    floor, why = build_floor(xl_floor, TransformerXLConfig.tiny(cutoffs=(20,)), 2)
    assert floor is None and "cutoffs (20,)" in why


def test_cpu_vs_torch_compares_the_cpu_presets_at_equal_parameter_counts():
    """The models of `--only cpu_vs_torch` are the cpu presets' (dropout off), and the PyTorch
    twins have exactly their parameter counts (4,978,688 and 4,739,344)."""
    torch = pytest.importorskip("torch")
    from train import lm, translate
    from train.bench.torch_reference import TorchTransformer
    from train.bench.torch_reference import count_params as torch_params
    from train.bench.xl_torch_reference import MemTransformerLM
    from train.core.state import count_params

    config = BenchConfig.full()
    assert config.torch_shapes == ((32, 16), (64, 32)) and config.torch_xl_batch == 24
    assert config.torch_transformer == translate.make_config(
        "transformer", "cpu"
    ).model_config.replace(dropout=0.0)
    xl_preset = lm.make_config("ptb", "cpu").model_config
    assert config.torch_xl == xl_preset.replace(
        dropout=0.0, dropatt=0.0, dtype=config.torch_xl.dtype
    )
    assert lm.make_config("ptb", "cpu").batch_size == config.torch_xl_batch

    def jax_params(model, *inputs):
        return count_params(jax.eval_shape(model.init, jax.random.PRNGKey(0), *inputs)["params"])

    dummy = jnp.ones((1, 8), jnp.int32)
    cfg = config.torch_transformer
    assert (
        jax_params(Transformer(cfg), dummy, dummy)
        == torch_params(TorchTransformer(cfg))
        == 4_978_688
    )
    xl = config.torch_xl
    torch_xl = MemTransformerLM(
        n_token=xl.vocab_size,
        n_layer=xl.n_layers,
        n_head=xl.n_heads,
        d_model=xl.d_model,
        d_head=xl.d_head,
        d_inner=xl.d_inner,
        tie_weight=xl.tie_weights,
        mem_len=xl.mem_len,
    )
    assert (
        jax_params(TransformerXL(xl), dummy, init_memory(xl, 1))
        == torch_params(torch_xl)
        == 4_739_344
    )
    del torch


@pytest.mark.slow
def test_cpu_vs_torch_section_reports_every_field_and_a_failed_compile(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    import os

    def failing_compile(fn, *args, **kwargs):
        def call(*a, **k):
            raise RuntimeError("inductor unavailable (simulated)\nmore detail")

        return call

    monkeypatch.setattr(torch, "compile", failing_compile)
    config = _tiny_bench_config().replace(
        torch_transformer=TransformerConfig.tiny(
            n_encoder_layers=1, n_decoder_layers=1, dropout=0.0, norm_first=True
        ),
        torch_shapes=((2, 8),),
        torch_xl=TransformerXLConfig.tiny(n_layers=1),
        torch_xl_batch=2,
        torch_steps=3,
        torch_warmup=1,
        torch_compile=True,
    )
    results = run_benchmarks(
        config,
        sections=("cpu_vs_torch",),
        out=str(tmp_path),
        profile=True,
        raise_errors=True,
        log=lambda m: None,
    )
    assert "matmul" not in results and results["meta"]["sections"] == ["cpu_vs_torch"]
    cmp = results["cpu_vs_torch"]
    xl_vocab = config.torch_xl.vocab_size
    threads = len(os.sched_getaffinity(0))
    assert cmp["threads"] == threads == torch.get_num_threads()
    assert [r["model"] for r in cmp["rows"]] == ["transformer", "transformer_xl"]
    for r in cmp["rows"]:
        assert r["n_params"] > 0
        assert r["arms"]["torch_compile"] is None
        assert r["compile_error"] == "RuntimeError: inductor unavailable (simulated)"
        assert r["project_over_compile"] is None
        project, eager = r["arms"]["project"], r["arms"]["torch_eager"]
        for arm in (project, eager):
            assert len(arm["times_s"]) == 3
            assert arm["median_s"] == statistics.median(arm["times_s"])
            assert arm["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / arm["median_s"])
            assert math.isfinite(arm["final_loss"])
        assert r["project_over_eager"] == pytest.approx(eager["median_s"] / project["median_s"])
        # The same model and loss on both sides, from different random weights, on uniformly
        # random tokens: nothing to learn in five steps, so each loss stays where its
        # initialisation puts it. XL: both at the official init (std 0.02, logits ~ 0), so
        # both at log V (4.14 and 4.17 measured, log 64 = 4.16). The Transformer's two
        # initialisations differ (4.46 and 4.04 measured, log 32 = 3.47): only their
        # closeness.
        if r["model"] == "transformer_xl":
            for arm in (project, eager):
                assert abs(arm["final_loss"] - math.log(xl_vocab)) < 0.1, arm["final_loss"]
            assert abs(project["final_loss"] - eager["final_loss"]) < 0.1
        else:
            assert abs(project["final_loss"] - eager["final_loss"]) < 0.5
        # Where the project's step went, its matrix products found by the program's HLO.
        assert r["profile"]["busy_us_per_step"] > 0
        assert r["profile"]["categories"].get("matmul", 0) > 0, r["profile"]
        # The pool's work outside op events comes on top of the op events, never instead.
        assert r["profile"]["busy_us_per_step"] >= r["profile"]["op_events_us_per_step"] > 0
        assert r["profile"]["wall_us_per_step"] > 0
        # The products floor: the same products as the step (remat's recomputation aside,
        # which these tiny steps do not add), timed in the same turns.
        (n_step, gflop_step), (n_floor, gflop_floor) = r["products"]["step"], r["products"]["floor"]
        assert n_step == n_floor > 0 and gflop_floor == pytest.approx(gflop_step, rel=1e-9)
        assert r["floor_error"] is None
        floors = r["arms"]["jax_floor"], r["arms"]["torch_floor"]
        assert all(len(arm["times_s"]) == 3 and arm["final_loss"] is None for arm in floors)
        assert r["eager_over_floor"] == pytest.approx(eager["median_s"] / floors[0]["median_s"])
        assert r["project_above_floor_ms"] == pytest.approx(
            (project["median_s"] - floors[0]["median_s"]) * 1e3
        )
    assert cmp["rows"][0]["tokens_per_step"] == 2 * 8
    assert cmp["rows"][1]["tokens_per_step"] == 2 * 8 and cmp["rows"][1]["mem_len"] == 8
    md = (tmp_path / "bench.md").read_text()
    assert "| project / eager | project / compile |" in md
    assert f"{threads} threads for both" in md and "torch.compile failed" in md
    steps_table, floor_table = md.split("Products floor:")
    rows = [line for line in steps_table.splitlines() if line.startswith("| Transformer")]
    assert len(rows) == 2 and all(line.endswith("| n/a |") for line in rows)  # no compile
    floor_rows = [line for line in floor_table.splitlines() if line.startswith("| Transformer")]
    assert len(floor_rows) == 2 and "products differ" not in floor_table
    assert md.count("Profile of Transformer") == 2
    for r in cmp["rows"]:
        # The busy time is read against the traced steps' own wall time, not the median's.
        traced_ms = r["profile"]["wall_us_per_step"] / 1e3
        untraced_ms = r["arms"]["project"]["median_s"] * 1e3
        assert f"{traced_ms:.1f} ms traced ({untraced_ms:.1f} ms untraced)" in md
