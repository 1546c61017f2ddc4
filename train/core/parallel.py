"""Data parallelism over every device: `jit` over a Mesh (the default) or `pmap`.

The same code runs on one GPU, eight CPU devices or a TPU slice, and on several hosts after
`jax.distributed.initialize()`:

  jit:  a 1-D `Mesh` with axis 'data'. The batch is a global array split along its leading axis
        (`NamedSharding(mesh, P('data'))`), params and optimizer state are replicated
        (`P()`), the carried `extra` state (XL memory, leading axis B) is split like the batch.
        XLA inserts the gradient all-reduce itself.
        With sharding='fsdp' (ZeRO-3, as MaxText's 'fsdp' axis) params and optimizer state are
        instead split over the same 'data' axis, each leaf along one axis (`fsdp_spec`): each
        device keeps 1/N of them, and XLA all-gathers a weight where the step uses it and
        reduce-scatters its gradient. Same maths, so the same losses as replicated.
  pmap: the classic per-device program with an explicit `lax.psum` over axis 'data'. Kept for
        the design's sake and for comparison; it computes the same update (see train.core.step), but
        its dropout masks are drawn per device, so with dropout on the two paths differ in the
        random draws (not in the maths). Single-process only.

Every host plans the same global batch (the batchers are deterministic given seed and step)
but builds only the rows of its own devices (`local_rows`), and `put_batch` assembles the
global array from every host's share: `jax.make_array_from_process_local_data`.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from train.core.config import check_parallel
from train.core.peers import HEARTBEAT_TIMEOUT_S
from train.core.processes import check_same_on_every_process  # noqa: F401 - its old home
from train.core.state import TrainState
from train.core.step import LossFn, make_eval_step, make_train_step

PyTree = Any
DATA_AXIS = "data"
ParallelMode = Literal["jit", "pmap"]
Sharding = Literal["replicated", "fsdp"]

# Setting this in the environment (e.g. by a cluster launcher script) asks for multi-host set-up
# exactly like the --distributed flag.
DISTRIBUTED_ENV = "TRAIN_DISTRIBUTED"


def maybe_initialize_distributed(
    enabled: bool = False,
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Starts JAX's distributed runtime when `enabled` or $TRAIN_DISTRIBUTED is 1/true. Must
    run before the first JAX computation. Returns whether JAX runs distributed.

    The coordinator address, process count and id come from the arguments, else from
    $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES and $JAX_PROCESS_ID, else from JAX's
    cluster detection (Cloud TPU, SLURM, Open MPI). On CPU devices the cross-process
    collectives run over gloo.
    """
    enabled = enabled or os.environ.get(DISTRIBUTED_ENV, "").lower() in ("1", "true", "yes")
    if not enabled or jax.distributed.is_initialized():
        return jax.distributed.is_initialized()
    # Cross-process collectives of CPU devices need gloo (harmless for accelerators).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    count = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    index = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    if address and (count is None or index is None):
        missing = [
            name
            for name, v in (
                ("--num_processes / JAX_NUM_PROCESSES", count),
                ("--process_id / JAX_PROCESS_ID", index),
            )
            if v is None
        ]
        try:  # a cluster JAX knows may still supply them
            jax.distributed.initialize(
                coordinator_address=address,
                num_processes=count,
                process_id=index,
                heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
            )
        except ValueError as e:
            raise ValueError(
                f"distributed: a coordinator address was given but not "
                f"{' and '.join(missing)} ({e})"
            ) from e
        return True
    # A process whose heartbeats stop is declared dead in seconds (`train.core.peers`).
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=count,
        process_id=index,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
    )
    return True


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}: expected an integer, got {value!r}") from None


def fsdp_spec(shape: Sequence[int], n_devices: int) -> P:
    """How fsdp splits one leaf of shape `shape` over `n_devices`: along its largest axis whose
    size the device count divides (the first of equal ones), e.g. [V, D] = [1000, 64] on 8
    devices -> P('data', None), [64, 1000] -> P(None, 'data'); replicated (P()) when no axis
    divides: scalars (Adam's step count), biases shorter than or not a multiple of N.

    The largest axis, so that one rule fits every leaf and the leaves that matter (embeddings,
    [D, F] kernels) split on a long axis; only divisible axes, because an uneven split would
    be padded, and a leaf with no such axis is too small for its saving to matter."""
    divisible = [axis for axis, size in enumerate(shape) if size > 0 and size % n_devices == 0]
    if not divisible:
        return P()
    axis = max(divisible, key=lambda a: (shape[a], -a))  # ties: the first axis
    return P(*([None] * axis), DATA_AXIS)


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh over `devices` (default: every device of every process) with axis 'data'."""
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.asarray(devices), (DATA_AXIS,))


class DataParallel:
    """Places state and batches and compiles the steps for one parallel mode.

    "Global layout" below means the jit layout: jax.Arrays over the mesh, params and optimizer
    state replicated (sharding='replicated') or split by `fsdp_spec` (sharding='fsdp'), `extra`
    split on axis 0. Checkpoints, evaluation and decoding use the global layout;
    `put_state` / `get_state` convert to and from the layout the train step wants.
    """

    def __init__(
        self,
        mode: ParallelMode = "jit",
        devices: Sequence[jax.Device] | None = None,
        *,
        sharding: Sharding = "replicated",
    ):
        check_parallel(mode, sharding)
        if mode == "pmap" and jax.process_count() > 1:
            raise ValueError(
                "parallel: the pmap path is single-process; use 'jit' on several hosts"
            )
        self.mode = mode
        self.sharding = sharding
        self.mesh = make_mesh(devices)
        self.n_devices = self.mesh.size
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P(DATA_AXIS))
        # This process's devices, in mesh order: it feeds their rows of every global batch.
        mesh_devices = list(self.mesh.devices.flat)
        self.local_devices = [d for d in mesh_devices if d.process_index == jax.process_index()]
        # They come in one contiguous run of the mesh (jax.devices() is ordered by process), so
        # this process's rows of a global batch do too; this is the run's first position.
        self._first_local = mesh_devices.index(self.local_devices[0])

    def round_rows(self, rows: int) -> int:
        """`rows` rounded up to a multiple of the device count (batch rows must split)."""
        return -(-rows // self.n_devices) * self.n_devices

    # ----------------------------------------------------------------- layouts
    def state_shardings(self, state: TrainState) -> TrainState:
        """The global-layout sharding of every leaf of `state` (a TrainState of shardings).
        The optimizer state (Adam's moments, the EMA) is split like the params: its leaves
        have the params' shapes, so each device updates exactly its own slice."""
        return state.replace(
            step=self.replicated,
            rng=self.replicated,
            params=self.param_sharding(state.params),
            opt_state=self.param_sharding(state.opt_state),
            extra=jax.tree.map(self._extra_sharding, state.extra),
        )

    def param_sharding(self, tree: PyTree) -> PyTree:
        """The sharding of each leaf (arrays or ShapeDtypeStructs) of a params-like tree:
        replicated, or `fsdp_spec` of its shape over the mesh."""
        if self.sharding == "replicated":
            return jax.tree.map(lambda _: self.replicated, tree)
        return jax.tree.map(
            lambda x: NamedSharding(self.mesh, fsdp_spec(np.shape(x), self.n_devices)), tree
        )

    def replicate(self, tree: PyTree) -> PyTree:
        """A (possibly fsdp-split) tree of global arrays -> the same values replicated on
        every device: decoding runs a step per token, and gathering the weights once beats
        gathering them in every step. A tree with no split array (replicated, or host
        values) is returned as it is."""
        split = [
            x
            for x in jax.tree.leaves(tree)
            if isinstance(x, jax.Array) and not x.sharding.is_equivalent_to(self.replicated, x.ndim)
        ]
        if not split:
            return tree
        return jax.jit(lambda t: t, out_shardings=self.replicated)(tree)

    def _extra_sharding(self, x) -> NamedSharding:
        # Carried state with a batch axis (XL memory) is split like the batch; scalars (a
        # moving-average baseline) are the whole batch's, so replicated.
        return self.batch_sharding if len(getattr(x, "shape", ())) else self.replicated

    def to_global(self, tree: PyTree, shardings: PyTree) -> PyTree:
        """Host (or any) values, the same on every process -> global arrays with `shardings`."""

        def put(x, sharding):
            if isinstance(x, jax.Array) and x.sharding == sharding:
                return x
            x = np.asarray(jax.device_get(x))
            return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

        return jax.tree.map(put, tree, shardings)

    def init_state(self, create: Callable[..., TrainState], *args) -> TrainState:
        """`create(*args)` run under jit straight into the global layout: every process builds
        its replicas from the same seed, no host round trip, one compilation."""
        abstract = jax.eval_shape(create, *args)
        return jax.jit(create, out_shardings=self.state_shardings(abstract))(*args)

    def put_state(self, state: TrainState) -> TrainState:
        """Global-layout (or host) state -> the layout this mode's train step takes."""
        rows = [x for x in jax.tree.leaves(state.extra) if np.ndim(x)]
        self._check_rows(rows, "the carried state (extra)")
        if self.mode == "pmap" and len(rows) < len(jax.tree.leaves(state.extra)):
            raise ValueError(
                "parallel: carried scalar state (hard attention's baseline) needs parallel='jit'"
            )
        if self.mode == "jit":
            return self.to_global(state, self.state_shardings(state))
        host = jax.device_get(state)
        n = self.n_devices
        stacked = host.replace(
            step=_stack(host.step, n),
            rng=_stack(host.rng, n),
            params=jax.tree.map(lambda x: _stack(x, n), host.params),
            opt_state=jax.tree.map(lambda x: _stack(x, n), host.opt_state),
            extra=jax.tree.map(lambda x: _split(x, n), host.extra),
        )
        return jax.pmap(lambda s: s, devices=self.local_devices)(stacked)

    def get_state(self, state: TrainState) -> TrainState:
        """The train step's layout -> global layout (identity for jit)."""
        if self.mode == "jit":
            return state
        host = jax.device_get(state)
        first = lambda x: x[0]  # noqa: E731 - replicas are identical; take device 0's.
        host = host.replace(
            step=first(host.step),
            rng=first(host.rng),
            params=jax.tree.map(first, host.params),
            opt_state=jax.tree.map(first, host.opt_state),
            extra=jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), host.extra),
        )
        return self.to_global(host, self.state_shardings(host))

    def local_rows(self, global_rows: int) -> slice:
        """The rows of a global batch of `global_rows` rows that this process builds and feeds:
        those of its own devices, one contiguous run (all of them on one process).

        The data-parallel contract: every process plans the same global batch of a step (the
        batchers are deterministic given seed and step) and gathers only these rows of it, so
        the global batch, and every number computed from it, does not depend on how many
        processes share the devices."""
        if global_rows % self.n_devices:
            raise ValueError(
                f"the batch: {global_rows} rows do not split over {self.n_devices} devices"
            )
        per_device = global_rows // self.n_devices
        start = self._first_local * per_device
        return slice(start, start + per_device * len(self.local_devices))

    def put_batch(self, batch: PyTree) -> PyTree:
        """This process's rows of a global batch (host arrays, leading axis: the
        `local_rows` of the global batch; on one process the whole batch) -> the train step's
        layout: a global array split on B (jit) or [devices, B/devices, ...] (pmap, which is
        single-process)."""
        if self.mode == "pmap":
            self._check_rows(batch, "the batch")
            return jax.tree.map(lambda x: _split(np.asarray(x), self.n_devices), batch)
        return jax.tree.map(self._put_local_rows, batch)

    def put_global(self, tree: PyTree) -> PyTree:
        """Host arrays with leading axis B (identical on every process) -> global arrays split
        on B over the mesh: the layout of evaluation and decoding in both modes."""
        self._check_rows(tree, "the batch")
        return jax.tree.map(
            lambda x: self._put_local_rows(np.asarray(x)[self.local_rows(np.shape(x)[0])]), tree
        )

    def _put_local_rows(self, x) -> jax.Array:
        x = np.asarray(x)
        n_local = len(self.local_devices)
        if x.ndim == 0 or x.shape[0] % n_local:
            raise ValueError(
                f"the batch: leading (batch) axis of shape {np.shape(x)} (this "
                f"process's rows) must be divisible by the device count {n_local} "
                "(this process's devices)"
            )
        global_shape = (x.shape[0] // n_local * self.n_devices,) + x.shape[1:]
        return jax.make_array_from_process_local_data(self.batch_sharding, x, global_shape)

    def _check_rows(self, tree: PyTree, what: str) -> None:
        for x in jax.tree.leaves(tree):
            if np.ndim(x) == 0 or np.shape(x)[0] % self.n_devices:
                raise ValueError(
                    f"{what}: leading (batch) axis of shape {np.shape(x)} must be divisible by "
                    f"the device count {self.n_devices}"
                )

    # ----------------------------------------------------------------- steps
    def compile_train_step(self, loss_fn: LossFn, state: TrainState, *, lr_schedule=None):
        """-> step(state, batch) -> (state, metrics), in this mode's layouts, with the state's
        buffers donated (updated in place). jit: a `CompiledStep`, which compiles once per
        batch shape and counts them (`compile_ahead` does it before the first step); pmap: the
        pmapped function, compiled lazily by JAX."""
        if self.mode == "pmap":
            step = make_train_step(loss_fn, lr_schedule=lr_schedule, axis_name=DATA_AXIS)
            return jax.pmap(
                step, axis_name=DATA_AXIS, donate_argnums=(0,), devices=self.local_devices
            )
        step = make_train_step(
            loss_fn, lr_schedule=lr_schedule, whole_gradient=self.sharding == "replicated"
        )
        state_sh = self.state_shardings(state)
        return CompiledStep(
            jax.jit(
                step,
                in_shardings=(state_sh, self.batch_sharding),
                out_shardings=(state_sh, self.replicated),
                donate_argnums=(0,),
            )
        )

    def compile_ahead(
        self,
        train_step,
        state: TrainState,
        batches: Sequence[PyTree],
        *,
        workers: int | None = None,
        background: bool = False,
        on_done: Callable[[int], None] | None = None,
    ) -> int:
        """Compiles `train_step` (from `compile_train_step`) for the shape of each of
        `batches` (host batches as `put_batch` takes them) -> how many shapes it compiles.

        Tracing and lowering hold the GIL, so they run in turn here; XLA's compilations release
        it and run in `workers` threads (default: one per shape, at most one per CPU core),
        before this returns or, with `background`, while the first steps run
        (`CompiledStep.compile_for`). Each executable is the one the step would build at that
        shape's first batch, so the numbers do not change. The pmap path stays lazy (0).
        `on_done(n)` runs once each is compiled, failed or dropped (`CompiledStep.compile_for`;
        at once for pmap).
        """
        if not isinstance(train_step, CompiledStep):
            if on_done is not None:
                on_done(0)
            return 0
        placed = {}
        for batch in batches:
            batch = self.put_batch(batch)
            placed.setdefault(batch_signature(batch), batch)
        return train_step.compile_for(
            state, list(placed.values()), workers=workers, background=background, on_done=on_done
        )

    def compile_eval_step(self, loss_fn: LossFn, state: TrainState):
        """-> eval(params, batch, extra) -> (sums, extra), always in the global layout (params
        of a global-layout state, batch and extra placed by `put_global`): evaluation is not
        where the pmap comparison matters, and one layout keeps it one code path."""
        state_sh = self.state_shardings(state)
        return jax.jit(
            make_eval_step(loss_fn),
            in_shardings=(state_sh.params, self.batch_sharding, self.batch_sharding),
            out_shardings=(self.replicated, self.batch_sharding),
        )

    def fetch_rows(self, x) -> np.ndarray:
        """A global array split on its rows (decoded tokens, ...) -> all of it on this host.
        Past one process the rows of other hosts' devices are gathered (a collective: every
        process must call it)."""
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    def fetch(self, metrics: Sequence[PyTree]) -> list[dict[str, float]]:
        """Device metrics (a list of per-step dicts) -> host floats, in ONE transfer."""
        host = jax.device_get(list(metrics))
        if self.mode == "pmap":  # psummed, so every device holds the same value
            host = [jax.tree.map(lambda x: x[0], m) for m in host]
        return [{k: float(v) for k, v in m.items()} for m in host]


def batch_signature(batch: PyTree) -> tuple:
    """A placed batch's tree structure, shapes and dtypes: what decides which executable of
    the train step runs it."""
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, tuple((tuple(np.shape(x)), np.dtype(x.dtype)) for x in leaves)


class CompiledStep:
    """step(state, batch) -> (state, metrics) through one executable per batch signature,
    each compiled by the public ahead-of-time path (`jitted.lower(state, batch).compile()`):
    the first batch of a new shape compiles its executable (as jit would), and
    `compile_for` compiles a set of them ahead, in threads, now or in the background while
    the first steps run. `compiled_shapes` counts them.

    jitted: the jit-wrapped step (its shardings and donation are the executables').
    """

    def __init__(self, jitted):
        self.jitted = jitted
        self.executables: dict[tuple, jax.stages.Compiled] = {}
        # Background compilations not yet claimed by a step: signature -> future.
        self._pending: dict[tuple, concurrent.futures.Future] = {}
        self._lowered: dict[tuple, jax.stages.Lowered] = {}
        self._lock = threading.Lock()
        # The background set: its members not yet compiled, failed or dropped, and how many
        # of it have an executable.
        self._left = self._made = 0
        self._on_done: Callable[[int], None] | None = None

    def __call__(self, state, batch):
        signature = batch_signature(batch)
        executable = self.executables.get(signature)
        if executable is None:
            executable = self._claim(signature, state, batch)
        return executable(state, batch)

    def _claim(self, signature, state, batch):
        """The executable of a shape met for the first time: a background one (waited for
        when it is compiling, compiled here when it has not started) or a new one."""
        future = self._pending.pop(signature, None)
        if future is None:
            executable = self.executables[signature] = self.jitted.lower(state, batch).compile()
        elif future.cancel():  # not started: compiled here, from its lowering
            executable = self._compile(signature, self._lowered[signature])
        else:
            future.result()  # compiling (or compiled) in the background; re-raises its error
            executable = self.executables[signature]
        return executable

    def _compile(self, signature, lowered) -> jax.stages.Compiled:
        """A member of the background set compiled (here or in a thread) and settled."""
        try:
            executable = lowered.compile()
        except BaseException:
            self._settle(signature, None)
            raise
        self._settle(signature, executable)
        return executable

    def _settle(self, signature, executable) -> None:
        """A member of the background set is over: compiled (`executable`), or failed or
        dropped (None). The last one runs `on_done`, whatever the others' outcome, so its
        owner (a run's cache tally) always hears that the set has ended."""
        with self._lock:
            if executable is not None:
                self.executables[signature] = executable
                self._made += 1
            self._lowered.pop(signature, None)
            self._left -= 1
            on_done, made = (self._on_done, self._made) if self._left == 0 else (None, 0)
            if on_done is not None:
                self._on_done = None
        if on_done is not None:
            on_done(made)

    def lower(self, state, batch):
        """The jitted step lowered for (state, batch): `.compile()` gives its executable."""
        return self.jitted.lower(state, batch)

    def compile_for(
        self,
        state,
        batches: Sequence[PyTree],
        *,
        workers: int | None = None,
        background: bool = False,
        on_done: Callable[[int], None] | None = None,
    ) -> int:
        """Compiles the executables of `batches` (placed batches) not compiled yet, the XLA
        compilations in threads -> how many it compiles.

        background: return once they are lowered (tracing and lowering hold the GIL, so they
        run here, in turn) and compile them in the threads while steps run. A step whose
        shape is compiling waits for it; one whose shape has not started compiles it itself.
        Without `background` it returns once all are compiled. `on_done(n)` runs once, when
        every one of them is over (compiled, failed, or dropped by `cancel_compiles`), in
        whichever thread settled the last (here when there is nothing to compile); n is how
        many got an executable. `wait_compiled` waits for them all.
        """
        todo = {}
        for batch in batches:
            signature = batch_signature(batch)
            if signature not in self.executables and signature not in self._pending:
                todo.setdefault(signature, batch)
        if not todo:
            if on_done is not None:
                on_done(0)
            return 0
        lowered = [self.jitted.lower(state, batch) for batch in todo.values()]
        workers = workers or min(len(lowered), os.cpu_count() or 1)
        self._left, self._made, self._on_done = len(todo), 0, on_done
        self._lowered.update(zip(todo, lowered))
        pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="compile-ahead"
        )
        for signature, low in zip(todo, lowered):
            self._pending[signature] = pool.submit(self._compile, signature, low)
        pool.shutdown(wait=False)  # its threads end once the queue is done
        if not background:
            self.wait_compiled()
        return len(todo)

    def wait_compiled(self) -> None:
        """Returns once every background compilation has its executable (re-raising the
        error of one that failed)."""
        for signature, future in list(self._pending.items()):
            future.result()
            del self._pending[signature]

    def cancel_compiles(self) -> None:
        """Drops the background compilations that have not started (a stopping run need not
        wait for them); those running finish in their threads."""
        for signature, future in list(self._pending.items()):
            if future.cancel():
                del self._pending[signature]
                self._settle(signature, None)

    @property
    def compiled_shapes(self) -> int:
        """How many batch shapes have an executable (ahead or at their first batch)."""
        return len(self.executables)


def _stack(x, n: int) -> np.ndarray:
    x = np.asarray(x)
    return np.broadcast_to(x[None], (n,) + x.shape).copy()


def _split(x, n: int) -> np.ndarray:
    x = np.asarray(x)
    return x.reshape((n, x.shape[0] // n) + x.shape[1:])
