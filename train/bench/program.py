"""What a compiled program holds: its kernels by category, their bytes and FLOPs, and an
estimate of the step's device time from them.

Read from the optimised HLO text (`compiled.as_text()`), so it works on any program,
including one compiled for a device this host does not have (`train.bench.targets`). A kernel
is a top-level instruction of the entry computation or of a loop body (a `while`'s body runs
its known trip count of times); its bytes are what it reads and writes, as a roofline prices
them: its outputs' sizes plus its operands', except that an operand a fusion reads only
through static slices counts the slices' sizes (XLA merges sibling products and updates into
one kernel over a shared buffer, each reading a part of it). `listed_bytes` keeps every
operand whole, the rule the program was first counted by (issue 62).

The estimate prices XLA's own kernels by roofline (bytes at a share of the memory bandwidth,
products at a matrix rate), adds a fixed gap per kernel (launch and scheduling between
kernels), and takes attention kernels (cuDNN's, the Pallas ones), whose speed no roofline
predicts, from `ATTENTION_TIMES`, a table of their measured device times. It is an estimate:
`benchmarks/` holds how it compares with measured steps.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

CATEGORIES = (
    "matmul",
    "attention",
    "elementwise and reductions",
    "copies and transposes",
    "collectives",
)

_DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
# `%name = SHAPE opcode(`: the shape may be a tuple, with nested parentheses.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")
_NOT_KERNELS = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "add-dependency",
    "opt-barrier",
    "partition-id",
    "replica-id",
    "while",
    "conditional",
    "call",
    "domain",
}
_COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "send",
    "recv",
)


def dtype_bytes(dtype: str) -> float:
    if dtype in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype]
    if dtype.startswith("f8"):
        return 1
    return 0  # token[] and the like carry no data


def shape_bytes(text: str) -> float:
    """Bytes of every array shape written in `text` (a tuple shape sums its elements)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(text):
        total += dtype_bytes(dtype) * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _dims(text: str) -> list[int]:
    match = _ARRAY.search(text)
    if match is None:
        return []
    return [int(d) for d in match.group(2).split(",") if d]


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # the result's shape text
    opcode: str
    operands: tuple[str, ...]  # operand names
    attrs: str  # everything after the operand list
    argument: str = ""  # the operand list's text when it names no instruction: parameter(N)'s N


def _split_instruction(name: str, rest: str) -> Instruction | None:
    # rest: SHAPE opcode(OPERANDS), attrs. The shape ends where the opcode's '(' follows a word
    # at paren depth 0.
    depth = 0
    i = 0
    while i < len(rest):
        c = rest[i]
        if c in "({[":
            if c == "(" and depth == 0:
                head = rest[:i]
                m = re.search(r"([\w\-]+)$", head)
                if m is not None and head[: m.start()].strip():
                    shape, opcode = head[: m.start()].strip(), m.group(1)
                    close, d = i, 0
                    while close < len(rest):
                        if rest[close] in "({[":
                            d += 1
                        elif rest[close] in ")}]":
                            d -= 1
                            if d == 0:
                                break
                        close += 1
                    inside = rest[i + 1 : close]
                    operands = tuple(re.findall(r"%([\w.\-]+)", inside))
                    argument = "" if operands else inside.strip()
                    return Instruction(name, shape, opcode, operands, rest[close + 1 :], argument)
            depth += 1
        elif c in ")}]":
            depth -= 1
        i += 1
    return None


def parse_hlo(text: str) -> tuple[dict[str, list[Instruction]], str | None]:
    """HLO module text -> ({computation: its instructions}, the entry computation's name)."""
    computations: dict[str, list[Instruction]] = {}
    entry = None
    current = None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header is not None:
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        inst = _split_instruction(match.group(1), match.group(2))
        if inst is not None:
            computations[current].append(inst)
    return computations, entry


def _attr(attrs: str, key: str) -> str | None:
    match = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
    return match.group(1) if match else None


def _trip_count(attrs: str) -> int:
    match = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', attrs)
    return int(match.group(1)) if match else 1


def _custom_call_target(attrs: str) -> str:
    """A custom call's target; for a Triton (Pallas) kernel, the kernel's own name after it
    ('__gpu$xla.gpu.triton:xl_relative_attention_fwd')."""
    match = re.search(r'custom_call_target="([^"]+)"', attrs)
    if match is None:
        return ""
    kernel = re.search(r'\bname = "([^"]+)"', attrs) if "triton" in match.group(1) else None
    return match.group(1) + (f":{kernel.group(1)}" if kernel else "")


@dataclasses.dataclass
class Kernel:
    """One kernel of a program, summed over its executions (`count`) in a step."""

    name: str
    category: str
    count: int
    bytes: float  # every execution's outputs + operands as read (sliced operands: the slices)
    flops: float  # matrix-product FLOPs (matmul kernels; attention's products in attention)
    target: str = ""  # a custom call's target, or a fusion's kind
    shapes: tuple[tuple[int, ...], ...] = ()  # an attention kernel's operand shapes
    listed_bytes: float = 0.0  # every execution's outputs + operands whole

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["shapes"] = [list(s) for s in self.shapes]
        return out


def _dot_flops(inst: Instruction, shapes: Mapping[str, str]) -> float:
    """2 x output elements x contracted size of one `dot`."""
    out = math.prod(_dims(inst.shape))
    lhs = _dims(shapes.get(inst.operands[0], "")) if inst.operands else []
    match = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", inst.attrs)
    contracted = math.prod(lhs[int(d)] for d in match.group(1).split(",") if d) if match else 1
    return 2.0 * out * contracted


def _gemm_custom_call_flops(inst: Instruction, shapes: Mapping[str, str]) -> float:
    out = _dims(inst.shape)
    lhs = _dims(shapes.get(inst.operands[0], "")) if inst.operands else []
    match = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', inst.attrs)
    if not match or not lhs:
        return 0.0
    dims = [int(d.strip().strip('"')) for d in match.group(1).split(",") if d.strip()]
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in dims)


def _category(inst: Instruction, called_has_dot: bool) -> str:
    op = inst.opcode
    name = inst.name.lower()
    if op.removesuffix("-start") in _COLLECTIVES or op in _COLLECTIVES:
        return "collectives"
    if op == "custom-call":
        target = _custom_call_target(inst.attrs).lower()
        if "fmha" in target or "attention" in target or "attention" in name:
            return "attention"
        if "gemm" in target or "matmul" in target or "cublas" in target:
            return "matmul"
        return "elementwise and reductions"
    if op in ("dot", "convolution") or (op == "fusion" and called_has_dot):
        return "matmul"
    if op in ("copy", "transpose", "copy-start") or (
        op == "fusion" and ("transpose" in name or "copy" in name)
    ):
        return "copies and transposes"
    return "elementwise and reductions"


def sliced_reads(body: list[Instruction]) -> dict[int, float]:
    """A fused computation's parameters that it reads only through static `slice`s (perhaps
    after a bitcast or a conversion: the pad logit `x[..., pad]` of a loss) -> {parameter
    number: the bytes of the parameter's elements those slices take}."""
    users: dict[str, list[Instruction]] = {}
    for inst in body:
        for operand in inst.operands:
            users.setdefault(operand, []).append(inst)

    def sliced_elements(name: str) -> int | None:
        uses = users.get(name)
        if not uses:
            return None
        total = 0
        for use in uses:
            if use.opcode == "slice":
                total += math.prod(_dims(use.shape))
            elif use.opcode in ("bitcast", "convert"):
                inner = sliced_elements(use.name)
                if inner is None:
                    return None
                total += inner
            else:
                return None
        return total

    reads = {}
    for inst in body:
        if inst.opcode == "parameter":
            elements = sliced_elements(inst.name)
            if elements is not None:
                size = math.prod(_dims(inst.shape))
                reads[int(inst.argument)] = shape_bytes(inst.shape) * elements / max(size, 1)
    return reads


def program_kernels(text: str) -> list[Kernel]:
    """The kernels of an optimised HLO module, merged by name (a loop body's kernel counts its
    trips), largest bytes first."""
    computations, entry = parse_hlo(text)
    if entry is None:
        raise ValueError("no ENTRY computation in the program text")
    shapes = {i.name: i.shape for insts in computations.values() for i in insts}
    dots = {
        name: sum(_dot_flops(i, shapes) for i in insts if i.opcode == "dot")
        for name, insts in computations.items()
    }
    # A TPU program's products are often convolutions inside fusions (their FLOPs are not
    # counted here; their kernels still go to 'matmul').
    convolutions = {
        name
        for name, insts in computations.items()
        if any(i.opcode == "convolution" for i in insts)
    }
    kernels: dict[str, Kernel] = {}
    # A fused computation's sliced reads, worked out once per computation, not per call.
    reads_of: dict[str, dict[int, float]] = {}

    def visit(computation: str, trips: int) -> None:
        for inst in computations.get(computation, ()):
            if inst.opcode == "while":
                body = _attr(inst.attrs, "body")
                if body:
                    visit(body, trips * _trip_count(inst.attrs))
                continue
            if inst.opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", inst.attrs)
                names = re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else []
                for branch in (_attr(inst.attrs, "true_computation"),
                               _attr(inst.attrs, "false_computation"), *names):  # fmt: skip
                    if branch:
                        visit(branch, trips)
                continue
            if inst.opcode == "call":
                callee = _attr(inst.attrs, "to_apply")
                if callee:
                    visit(callee, trips)
                continue
            if inst.opcode in _NOT_KERNELS or inst.opcode.endswith("-done"):
                continue
            called = _attr(inst.attrs, "calls")
            flops = dots.get(called, 0.0) if called else 0.0
            if inst.opcode == "dot":
                flops = _dot_flops(inst, shapes)
            category = _category(inst, flops > 0 or called in convolutions)
            if category == "matmul" and inst.opcode == "custom-call":
                flops = _gemm_custom_call_flops(inst, shapes)
            out = shape_bytes(inst.shape)
            listed = out + sum(shape_bytes(shapes.get(o, "")) for o in inst.operands)
            if called and called not in reads_of:
                reads_of[called] = sliced_reads(computations.get(called, ()))
            read = reads_of.get(called, {})
            size = out + sum(
                min(read.get(i, math.inf), shape_bytes(shapes.get(o, "")))
                for i, o in enumerate(inst.operands)
            )
            kernel = kernels.get(inst.name)
            if kernel is None:
                target = _custom_call_target(inst.attrs) or (_attr(inst.attrs, "kind") or "")
                operand_shapes = tuple(tuple(_dims(shapes.get(o, ""))) for o in inst.operands)
                kernel = kernels[inst.name] = Kernel(
                    inst.name,
                    category,
                    0,
                    0.0,
                    0.0,
                    target,
                    operand_shapes if category == "attention" else (),
                )
            kernel.count += trips
            kernel.bytes += trips * size
            kernel.listed_bytes += trips * listed
            kernel.flops += trips * flops

    visit(entry, 1)
    return sorted(kernels.values(), key=lambda k: -k.bytes)


@dataclasses.dataclass(frozen=True)
class AttentionTime:
    """A measured device time of one attention kernel call.

    kind: 'cudnn_fwd' | 'cudnn_bwd' (cuDNN's fused attention; with_bias: with a bias input,
      Transformer-XL's position term, whose backward also computes its gradient) or
      'pallas_fwd' | 'pallas_dq' | 'pallas_dkv' (xl_jax.fused_attention's kernels).
    shape: (B, H, T, S, K) of the call.
    us: microseconds per call on the device.
    source: where it was measured.
    """

    kind: str
    with_bias: bool
    shape: tuple[int, int, int, int, int]
    us: float
    device: str
    source: str


# Per-call device times from the H200 profiles (bf16; the profiles' per-step totals over their
# calls per step). The Transformer's cuDNN kernels: `train.bench` on 2026-11-27 (18 calls a
# step; JAX hands cuDNN the padding and causal masks as a bias); Transformer-XL's:
# enwik8_base, `auto` and `pallas`, 2026-11-28 (12 calls a step; its backward, whose bias is
# the position term, is cuDNN's bprop, fmha_dbias and matmul_dq kernels together).
ATTENTION_TIMES = (
    AttentionTime("cudnn_fwd", True, (768, 8, 32, 32, 64), 160.9, "NVIDIA H200",
                  "benchmarks/h200_2026-11-27/train_bench.json"),
    AttentionTime("cudnn_bwd", True, (768, 8, 32, 32, 64), 231.5, "NVIDIA H200",
                  "benchmarks/h200_2026-11-27/train_bench.json"),
    AttentionTime("cudnn_fwd", True, (22, 8, 512, 1024, 64), 121.4, "NVIDIA H200",
                  "benchmarks/h200_2026-11-28/ab_run3.json"),
    AttentionTime("cudnn_bwd", True, (22, 8, 512, 1024, 64), 565.4, "NVIDIA H200",
                  "benchmarks/h200_2026-11-28/ab_run3.json"),
    AttentionTime("pallas_fwd", False, (22, 8, 512, 1024, 64), 455.6, "NVIDIA H200",
                  "benchmarks/h200_2026-11-28/ab_run3.json"),
    AttentionTime("pallas_dq", False, (22, 8, 512, 1024, 64), 1279.7, "NVIDIA H200",
                  "benchmarks/h200_2026-11-28/ab_run3.json"),
    AttentionTime("pallas_dkv", False, (22, 8, 512, 1024, 64), 678.3, "NVIDIA H200",
                  "benchmarks/h200_2026-11-28/ab_run3.json"),
)  # fmt: skip


def attention_kind(kernel: Kernel) -> tuple[str, bool] | None:
    """A kernel's row kind in ATTENTION_TIMES and whether it has a bias, None if not one."""
    if kernel.category != "attention":
        return None
    target = kernel.target.lower()
    if "fmha" in target:
        direction = "bwd" if "backward" in target else "fwd"
        return f"cudnn_{direction}", "bias" in target
    for part in ("dkv", "dq", "fwd"):  # xl_jax.fused_attention's kernels, by their names
        if target.endswith(f"_{part}"):
            return f"pallas_{part}", False
    return None


def _attention_shape(kernel: Kernel) -> tuple[int, int, int, int, int] | None:
    """(B, H, T, S, K) of a cuDNN or Pallas attention call: its first [B, T, H, K] operand
    is the queries; the longest operand of the same B, H and K, the keys."""
    four = [s for s in kernel.shapes if len(s) == 4]
    if len(four) < 2:
        return None
    b, t, h, k = four[0]
    s = max(x[1] for x in four if (x[0], x[2], x[3]) == (b, h, k))
    return b, h, t, s, k


def attention_time(kernel: Kernel, device: str) -> tuple[float, str] | None:
    """(seconds for all its calls, how it was found) from ATTENTION_TIMES: the row of the same
    kind, bias and shape ('measured'); else the row of the same kind and bias (or kind alone)
    nearest in B*H*T*S*K, scaled by it ('scaled'). None when no row of its kind was measured
    on `device`."""
    kind = attention_kind(kernel)
    shape = _attention_shape(kernel)
    if kind is None or shape is None:
        return None
    rows = [r for r in ATTENTION_TIMES if (r.kind, r.with_bias) == kind and r.device == device]
    if not rows:
        rows = [r for r in ATTENTION_TIMES if r.kind == kind[0] and r.device == device]
    if not rows:
        return None
    for row in rows:
        if row.shape == shape and row.with_bias == kind[1]:
            return kernel.count * row.us * 1e-6, "measured"
    size = math.prod(shape)
    row = min(rows, key=lambda r: abs(math.log(math.prod(r.shape) / size)))
    return kernel.count * row.us * 1e-6 * size / math.prod(row.shape), "scaled"


@dataclasses.dataclass(frozen=True)
class Pricing:
    """How the estimate prices a device.

    bandwidth: bytes/s XLA's memory-bound kernels reach (a share of the datasheet's).
    matmul_rate: FLOP/s of the products (bf16).
    gap_s: the device's idle time per kernel (launches and scheduling between kernels).
    device: the device kind whose measured attention times apply.
    """

    bandwidth: float
    matmul_rate: float
    gap_s: float
    device: str


# Fitted to the H200 profiles of 2026-11-27 and 2026-11-28: XLA's kernels reached about 0.8 of
# the datasheet's 4.8 TB/s, its products about 652 TFLOP/s (0.66 of the dense bf16 peak), and
# a step's wall time exceeded its kernels' busy time by about 4.8 us per kernel.
BANDWIDTH_SHARE = 0.8
MATMUL_SHARE = 0.66
GAP_S = 4.8e-6


def pricing_for(target) -> Pricing:
    """The estimate's constants for a target. The shares and the gap were measured on an
    H200; a TPU runs its program without a launch per kernel, so its gap is 0 and its estimate
    a roofline alone."""
    return Pricing(
        bandwidth=BANDWIDTH_SHARE * target.memory_bandwidth,
        matmul_rate=MATMUL_SHARE * target.bf16_peak,
        gap_s=0.0 if target.platform == "tpu" else GAP_S,
        device=target.device_name,
    )


def summarize(kernels: list[Kernel], pricing: Pricing, *, top: int = 10) -> dict[str, Any]:
    """The program's kernels by category (count, bytes, FLOPs, estimated seconds), the
    attention kernels' counts by target (a custom call's), the `top` largest by bytes, and
    the estimated step time: kernel times plus a gap per kernel."""
    by_category: dict[str, dict[str, float]] = {
        c: {"kernels": 0, "bytes": 0.0, "listed_bytes": 0.0, "flops": 0.0, "est_s": 0.0}
        for c in CATEGORIES
    }
    unpriced = []
    sources: Counter = Counter()
    for k in kernels:
        roofline = max(k.bytes / pricing.bandwidth, k.flops / pricing.matmul_rate)
        est = roofline
        if k.category == "attention":
            found = attention_time(k, pricing.device)
            if found is None:
                unpriced.append(k.name)
            else:
                est, how = found
                sources[how] += k.count
        row = by_category[k.category]
        row["kernels"] += k.count
        row["bytes"] += k.bytes
        row["listed_bytes"] += k.listed_bytes
        row["flops"] += k.flops
        row["est_s"] += est
    n = sum(k.count for k in kernels)
    busy = sum(r["est_s"] for r in by_category.values())
    attention: Counter = Counter()
    for k in kernels:
        if k.category == "attention":
            attention[k.target] += k.count
    return {
        "kernels": n,
        "bytes": sum(k.bytes for k in kernels),
        "listed_bytes": sum(k.listed_bytes for k in kernels),
        "categories": by_category,
        "attention_kernels": dict(attention),
        "top": [k.as_dict() for k in kernels[:top]],
        "estimate": {
            "busy_s": busy,
            "gap_s": n * pricing.gap_s,
            "step_s": busy + n * pricing.gap_s,
            "attention_from_table": dict(sources),
            "attention_unpriced": unpriced,
            "pricing": dataclasses.asdict(pricing),
            "note": "an estimate from the compiled program, not a measurement",
        },
    }
