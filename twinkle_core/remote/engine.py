"""``RemoteEngine``: any engine as ``dp_size`` Ray actors, held by an ordinary ``Sampler``.

It is the engine of what ``TorchSampler(..., remote_group="sampler")`` (or
``create_sampler("vllm", ..., remote_group="sampler")``) returns in ``"ray"``
mode. The driver's ``Sampler`` does what it does for every engine (input
normalisation and encoding, validation, the adapter table, versions, the
lock, submit, streaming, abort, resume); this engine runs each run's prompts
on the replicas and brings their sequences back, and takes adapter, template
and weight changes to every replica, recording them so a replica that dies
can be rebuilt in the same state. Each replica hosts the real engine (a
``Sampler`` around it, see :mod:`twinkle_core.remote._host`).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

from twinkle_core.adapter_input import AdapterInput
from twinkle_core.data_format import SampledSequence, SampleResponse, SamplingParams
from twinkle_core.engine import Engine, EngineContext, EngineInfo, EngineRun
from twinkle_core.errors import ConfigError
from twinkle_core.mesh import DeviceGroup, DeviceMesh
from twinkle_core.remote._balance import item_cost, split_by_cost
from twinkle_core.remote._pool import Op, ReplicaPool, _Died, add_note
from twinkle_core.remote._runtime import PlacedGroup, import_ray
from twinkle_core.remote.errors import ReplicaLostError
from twinkle_core.remote.remote_class import held_engine
from twinkle_core.state import AppliedWithError

__all__ = ["RemoteEngine"]

#: Calls a replica's actor serves at once (shares of concurrent calls, aborts, state changes).
_REPLICA_THREADS = 64


class RemoteEngine(Engine):
    """``mesh.dp_size`` Ray actors of ``tp_size`` devices each, each running ``engine_class(*args, **kwargs)``.

    * A run is split across the replicas in service, balanced by work
      (``num_samples x (prompt tokens + max_tokens)``; prompts of similar
      length together), and its sequences are reported as each replica
      finishes them; the run's stop switch stops every replica's share.
    * Adapter, template and weight changes reach every replica and return once
      all applied them; tensors go into Ray's object store once and every
      replica reads that copy, with the one version the sampler gives.
    * A replica that dies is rebuilt with the same arguments on the same
      devices; the template, adapters and weights are re-applied before it
      takes work, and the interrupted share is run again once. If it cannot be
      rebuilt, :class:`~twinkle_core.remote.ReplicaLostError` says so and the
      others keep serving.

    Attributes:
        engine_class: what each replica builds (a ``Sampler`` class).
        device_mesh: the layout.
        group: the device group the replicas run on.
        pool: the replicas.
    """

    def __init__(
        self,
        context: EngineContext,
        engine_class: type,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        placed: PlacedGroup,
        mesh: DeviceMesh,
    ) -> None:
        super().__init__(context)
        self.engine_class = engine_class
        self.device_mesh = mesh
        self.group: DeviceGroup = placed.group
        # ``Sampler(SomeEngine, ...)``: the engine object's class names it.
        self.label = (held_engine(engine_class, args) or engine_class).__name__
        # version -> (ref of the update's tensors, names still current from it)
        self._weight_ops: dict[int, tuple[Any, set[str]]] = {}
        self._adapter_ops: dict[str, tuple[int, Any, Any, dict[str, Any]]] = {}
        self._template_op: Any = None
        self.pool = ReplicaPool(
            engine_class,
            args,
            kwargs,
            placed=placed,
            mesh=mesh,
            label=f"{self.label} on group {placed.name!r}",
            # threads: a replica serves several calls' shares at once (its engine batches or serialises
            # them), and an abort reaches a share while it runs
            max_concurrency=max(int(getattr(engine_class, "remote_max_concurrency", 1)), _REPLICA_THREADS),
            replay=self._replay_ops,
        )
        self.pool.start()
        try:
            info = self.pool.first_info()
            # The replicas' template encodes here: the sampler checks every prompt before any replica works.
            self._replicas_template = self._fetch_template()
            self.info = EngineInfo(
                name=info.get("engine_name") or self.label,
                max_model_len=info["max_model_len"],
                vocab_size=info.get("vocab_size"),
                supported_params=frozenset(info.get("supported_params", ())),
                concurrent=True,
            )
            self._prompt_limits: dict[str, int] = dict(info.get("max_prompt_len") or {})
            context.init_template(self._replicas_template)
            context.restore_version(info.get("weights_version", 0))
        except BaseException:
            self.pool.close()
            raise

    def _fetch_template(self) -> Any:
        try:
            return self.pool.run(self.pool.pick(), "get", "template")
        except ImportError as exc:  # its tokenizer's library is missing here
            raise ConfigError(
                f"The replicas' chat template needs {exc.name or exc} in this process: the driver encodes the"
                " prompts with it (no model files needed). Install the tokenizer's library here (transformers for"
                " a Hugging Face tokenizer)."
            ) from exc

    def __repr__(self) -> str:
        m = self.device_mesh
        return (
            f"RemoteEngine({self.label}, group={self.group.name!r}, dp_size={m.dp_size},"
            f" tp_size={m.tp_size}, replicas in service={len(self.pool.alive())})"
        )

    def max_prompt_len(self, params: SamplingParams) -> int:
        """The replicas' engine's limit (what each replica reported), so a prompt it refuses is refused here."""
        limit = self._prompt_limits.get("generate" if params.max_tokens > 0 else "score")
        return super().max_prompt_len(params) if limit is None else limit

    # -- state changes ---------------------------------------------------------------------
    def _replay_ops(self) -> tuple[list[Op], int]:
        """What a rebuilt replica needs: template, adapters and weight updates in version order; the version."""
        ops: list[tuple[int, Op]] = []
        for version, (ref, _names) in self._weight_ops.items():
            ops.append((version, ("update_weights", (ref,), {"version": version, "check_finite": False})))
        for name, (version, source, weights, kwargs) in self._adapter_ops.items():
            call_kwargs = {"weights": weights, "version": version, "check_finite": False, **kwargs}
            ops.append((version, ("add_adapter_to_model", (name, source), call_kwargs)))
        ordered = [op for _, op in sorted(ops, key=lambda x: x[0])]
        if self._template_op is not None:
            ordered.insert(0, ("set_template", (self._template_op,), {}))
        return ordered, self.context.weights_version

    def template_changed(self) -> None:
        """Set the sampler's new template on every replica (the instance, tokenizer included)."""
        template = self.context.template
        if template is self._replicas_template:
            return

        def record() -> None:
            self._template_op = self._replicas_template = template

        self._apply("set_template", (template,), {}, record=record)

    def load_adapter(self, adapter: AdapterInput, *, version: int, **kwargs: Any) -> str:
        """Load or replace a LoRA adapter on every replica.

        A folder must be readable at the same path here and on every node (a
        shared file system): it is read here once, so a bad one is refused
        before any replica changes. Tensors in memory go into Ray's object
        store once.
        """
        name = adapter.name
        source: Any = str(adapter.folder) if adapter.folder is not None else adapter.config
        ref = import_ray().put(adapter.tensors) if adapter.folder is None else None
        self._apply(
            "add_adapter_to_model",
            (name, source),
            # the driver already checked the values are finite
            {"weights": ref, "version": version, "check_finite": False, **kwargs},
            record=lambda: self._adapter_ops.__setitem__(name, (version, source, ref, kwargs)),
        )
        return adapter.source

    def remove_adapter(self, name: str) -> None:
        self._apply("remove_adapter", (name,), {}, record=lambda: self._adapter_ops.pop(name, None))

    def update_weights(self, named_tensors: list[tuple[str, Any]], *, version: int) -> None:
        """Replace base weights on every replica, with the one new version they all carry.

        The tensors are put into Ray's object store once; every replica reads
        that copy. The driver keeps the object ref (for each tensor name, the
        latest update holding it) so a rebuilt replica gets the same weights:
        superseded updates are released.
        """
        ref = import_ray().put(named_tensors)
        names = {name for name, _ in named_tensors}

        def record() -> None:
            for old_version in list(self._weight_ops):
                _old_ref, old_names = self._weight_ops[old_version]
                old_names -= names
                if not old_names:
                    del self._weight_ops[old_version]
            self._weight_ops[version] = (ref, set(names))

        self._apply("update_weights", (ref,), {"version": version, "check_finite": False}, record=record)

    def _apply(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, record: Callable[[], object]
    ) -> None:
        """Make a state change on every replica and record it (for rebuilds), once at least one applied it.

        If every replica rejects it (bad input: they all agree), nothing
        changes and the first error is raised. If only some applied it, it is
        kept, the others are rebuilt with it (so all replicas stay alike), and
        the first error is raised as :class:`AppliedWithError` (the sampler then
        records the change) with a note saying so.
        """
        self.pool.check_open()
        values, errors = self.pool.broadcast_collect("call", method, *args, **kwargs)
        if errors and not values:
            raise errors[min(errors)]
        record()
        if not errors:
            return
        first = errors[min(errors)]
        version = kwargs.get("version")
        out_of_step = [i for i in sorted(errors) if not isinstance(errors[i], ReplicaLostError)]
        for i in out_of_step:
            try:
                self.pool.restart(i, errors[i])
            except Exception as exc:  # lost: the note below still tells the story
                add_note(first, str(exc))
        done = f"Replicas {sorted(values)} applied {method}" + (f" (version {version})" if version is not None else "")
        add_note(
            first, f"{done}; replicas {out_of_step} failed and were rebuilt with it." if out_of_step else f"{done}."
        )
        raise AppliedWithError(first)

    # -- runs ------------------------------------------------------------------------------
    def run(self, run: EngineRun) -> list[SampleResponse]:
        """Run ``run``'s prompts on the replicas, each share streamed back into ``run`` as its sequences finish.

        Every share runs in its replica as one call (``ReplicaHost.stream_shard``,
        which continues each prompt from ``run.generated`` with ``run.sample_base``
        and ``run.max_tokens``); its sequences reach ``run.finish`` as they
        finish there. When ``run``'s stop switch is set, every replica's share
        is stopped. A replica that dies is rebuilt and its share run again once
        (what it had streamed stands: ``run.finish`` keeps the first report of
        each sequence, and so does the result). If a share fails, the others
        are stopped and the first failure (in input order) is raised.
        """
        self.pool.check_open()
        prompts, params = run.prompts, run.params
        alive = self.pool.alive()
        costs = [
            item_cost(len(p.input_ids), params.replace(max_tokens=budget)) for p, budget in zip(prompts, run.max_tokens)
        ]
        shards = [(replica, shard) for replica, shard in zip(alive, split_by_cost(costs, len(alive))) if shard]
        out: list[SampleResponse | None] = [None] * len(prompts)
        errors: dict[int, BaseException] = {}
        started: list[tuple[int, str]] = []
        started_lock = threading.Lock()
        failed = threading.Event()

        def stop_all() -> None:
            with started_lock:
                targets = list(started)
            for replica, shard_id in targets:
                self.pool.call_nowait(replica, "abort_shard", shard_id)

        def serve(order: int, replica: int, shard: list[int]) -> None:
            cont = (
                [run.sample_base[k] for k in shard],
                [run.generated[k] for k in shard],
                [run.max_tokens[k] for k in shard],
            )
            streamed: dict[tuple[int, int], SampledSequence] = {}
            for attempt in range(2):
                shard_id = uuid.uuid4().hex
                with started_lock:
                    started.append((replica, shard_id))
                if run.stopped() or failed.is_set():
                    self.pool.call_nowait(replica, "abort_shard", shard_id)
                args = (shard_id, [prompts[k] for k in shard], list(shard), params, run.adapter_name, "raise", cont)
                try:
                    responses = self._read_stream(replica, args, shard, run, streamed, failed)
                except _Died as died:
                    if attempt == 1:
                        errors[order] = self.pool.died_twice(died)
                        break
                    try:
                        self.pool.recover(died)
                    except BaseException as exc:
                        errors[order] = exc
                        break
                    continue
                except BaseException as exc:
                    errors[order] = exc
                    break
                for (k, s), seq in streamed.items():  # a retried share: what was streamed stands
                    responses[k].sequences[s] = seq
                for k, response in zip(shard, responses):
                    out[k] = response
                return
            failed.set()
            stop_all()

        run.stop_event.add_callback(stop_all)
        try:
            threads = [
                threading.Thread(target=serve, args=(order, replica, shard), name="twinkle-remote-share", daemon=True)
                for order, (replica, shard) in enumerate(shards)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            run.stop_event.remove_callback(stop_all)
        if errors:
            raise errors[min(errors)]
        return out  # type: ignore[return-value]

    def _read_stream(
        self,
        replica: int,
        args: tuple[Any, ...],
        shard: list[int],
        run: EngineRun,
        streamed: dict[tuple[int, int], SampledSequence],
        failed: threading.Event,
    ) -> list[SampleResponse]:
        """Read one share's stream: report each sequence to ``run``; return the share's responses."""
        incarnation, stream = self.pool.stream(replica, "stream_shard", *args)
        ray = import_ray()
        while True:
            try:
                ref = next(stream)
            except StopIteration:  # pragma: no cover - the host always ends with the responses
                raise RuntimeError(f"{self.pool.where(replica)} ended a share without its responses.") from None
            except ray.exceptions.RayActorError as exc:
                raise _Died(replica, incarnation, exc) from exc
            value = self.pool.result(replica, incarnation, ref)
            if isinstance(value, list):
                return value
            k, s, seq = value
            if failed.is_set() or (k, s) in streamed:
                continue  # another share failed: the call raises; or already reported before a retry
            streamed[(k, s)] = seq
            run.finish(shard[k], s, seq)

    # -- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        self.pool.close()
