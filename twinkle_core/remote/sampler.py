"""``RemoteSampler``: any engine as ``dp_size`` Ray actors, behind the ordinary ``Sampler`` API.

It is what ``TorchSampler(..., remote_group="sampler")`` (or
``create_sampler("vllm", ..., remote_group="sampler")``) returns in
``"ray"`` mode. The driver object keeps no engine: it splits ``sample()``
across the replicas and gathers the responses in input order; adapter,
template and weight changes go to every replica, and are recorded so a
replica that dies can be rebuilt in the same state.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from twinkle_core.adapter_input import AdapterInput
from twinkle_core.data_format import InputFeature, SampledSequence, SampleResponse, SamplingParams, Trajectory
from twinkle_core.mesh import DeviceGroup, DeviceMesh
from twinkle_core.remote._balance import estimate_prompt_tokens, item_cost, split_by_cost, trajectory_chars
from twinkle_core.remote._pool import Op, ReplicaPool, _Died, add_note
from twinkle_core.remote._runtime import PlacedGroup, import_ray, register_owner
from twinkle_core.remote.errors import ReplicaLostError
from twinkle_core.remote.remote_class import ReplicaViews, build_object, held_engine
from twinkle_core.requests import CallFeed, EngineRun, Finished
from twinkle_core.sampler import AppliedWithError, OnInvalid, Sampler
from twinkle_core.template import Template

__all__ = ["RemoteSampler", "build_remote"]

#: Calls a replica's actor serves at once (shares of concurrent calls, aborts, state changes).
_REPLICA_THREADS = 64


def build_remote(cls: type, remote_group: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What ``cls(*args, remote_group=..., **kwargs)`` returns: replicas in ``"ray"`` mode, else a local object.

    A ``Sampler`` class becomes a :class:`RemoteSampler`; any other class is
    built by :func:`~twinkle_core.remote.remote_class.build_object`.

    Raises:
        UnknownGroupError: the group was never initialised.
        InvalidMeshError: the mesh does not fit the group.
        TypeError: the arguments do not fit the constructor.
    """
    remote_type = RemoteSampler if isinstance(cls, type) and issubclass(cls, Sampler) else None
    return build_object(cls, remote_group, args, kwargs, remote_type=remote_type)


class RemoteSampler(ReplicaViews, Sampler):
    """A sampler whose engine runs as ``mesh.dp_size`` Ray actors of ``tp_size`` devices each.

    Built by passing ``remote_group=`` to any engine in ``"ray"`` mode; not
    meant to be constructed directly. It has the whole ``Sampler`` API:

    * ``sample`` splits the inputs across the replicas in service, balanced by
      estimated work (each input whole; prompts of similar length together, in
      runs of near-equal cost), runs them concurrently and returns the
      responses in input order.
    * ``add_adapter_to_model``, ``remove_adapter``, ``set_template`` and
      ``update_weights`` reach every replica and return once all applied them;
      tensors go into Ray's object store once and every replica reads that copy;
      every replica gets the same explicit version. They wait for running
      ``sample`` calls, and hold new ones back, so no call mixes versions.
    * An exception in a replica is raised here as its own type, the replica
      named in a note and the remote traceback chained as its cause.
    * A replica that dies is rebuilt with the same arguments on the same
      devices; the template, adapters and weights are re-applied before it
      takes work, and the interrupted work is retried once. If it cannot be
      rebuilt, :class:`~twinkle_core.remote.ReplicaLostError` says so and the
      other replicas keep serving.

    Attributes:
        engine_class: the engine each replica runs.
        device_mesh: the layout.
        group: the device group the replicas run on.
    """

    #: The replicas run the engine's calls concurrently; this object only splits and gathers.
    concurrent_samples = True

    def __init__(
        self,
        engine_class: type[Sampler],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        placed: PlacedGroup,
        mesh: DeviceMesh,
    ) -> None:
        super().__init__()
        self.engine_class = engine_class
        # ``Sampler(SomeEngine, ...)``: the engine object's class names it; its info comes from a replica.
        held = held_engine(engine_class, args)
        self.engine_name = engine_class.engine_name
        self.supported_params = engine_class.supported_params  # type: ignore[misc]
        self.device_mesh = mesh
        self.group: DeviceGroup = placed.group
        # version -> (ref of the update's tensors, names still current from it)
        self._weight_ops: dict[int, tuple[Any, set[str]]] = {}
        self._adapter_ops: dict[str, tuple[int, Any, Any, dict[str, Any]]] = {}
        self._template_op: tuple[Any, dict[str, Any]] | None = None
        self._remote_template: Template | None = None
        self._template_fetch = threading.Lock()
        self._chars = 0
        self._tokens = 0
        self._engine_label = (held or engine_class).__name__
        label = f"{self._engine_label} on group {placed.name!r}"
        self._pool = ReplicaPool(
            engine_class,
            args,
            kwargs,
            placed=placed,
            mesh=mesh,
            label=label,
            # threads: a replica serves several calls' shares at once (its engine batches or serialises
            # them), and an abort reaches a share while it runs
            max_concurrency=max(int(getattr(engine_class, "remote_max_concurrency", 1)), _REPLICA_THREADS),
            replay=self._replay_ops,
        )
        self._pool.start()
        info = self._pool.first_info()
        self._max_model_len: int = info["max_model_len"]
        self._vocab_size: int | None = info.get("vocab_size")
        if held is not None:
            self.engine_name = info.get("engine_name", "")
            self.supported_params = frozenset(info.get("supported_params", ()))  # type: ignore[misc]
        self._restore_version(info.get("weights_version", 0))
        register_owner(self)

    def __repr__(self) -> str:
        m = self.device_mesh
        return (
            f"RemoteSampler({self._engine_label}, group={self.group.name!r}, dp_size={m.dp_size},"
            f" tp_size={m.tp_size}, replicas in service={len(self._pool.alive())})"
        )

    # -- introspection ---------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int | None:
        return self._vocab_size

    @property
    def template(self) -> Template:
        """The replicas' template (fetched from one replica on first use; needs the tokenizer's library here)."""
        with self._template_fetch:
            if self._remote_template is None:
                self._remote_template = self._pool.run(self._pool.pick(), "get", "template")
            return self._remote_template

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
            template, kwargs = self._template_op
            ordered.insert(0, ("set_template", (template,), kwargs))
        return ordered, self.weights_version

    def set_template(self, template: type[Template] | Template | str, **kwargs: Any) -> None:
        """Set the chat template on every replica (a registered name, a class or an instance)."""
        self._pool.check_open()
        with self._exclusive():

            def record() -> None:
                self._template_op = (template, kwargs)
                with self._template_fetch:
                    self._remote_template = None
                self._chars = self._tokens = 0

            try:
                self._apply("set_template", (template,), kwargs, record=record)
            except AppliedWithError as applied:
                raise applied.error from None

    def _load_adapter(self, adapter: AdapterInput, *, version: int, **kwargs: Any) -> str:
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

    def _remove_adapter(self, name: str) -> None:
        self._apply(
            "remove_adapter",
            (name,),
            {},
            record=lambda: self._adapter_ops.pop(name, None),
        )

    def _update_weights(self, named_tensors: list[tuple[str, Any]], *, version: int) -> None:
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

        kwargs = {"version": version, "check_finite": False}
        self._apply("update_weights", (ref,), kwargs, record=record)

    def _apply(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, record: Callable[[], object]
    ) -> None:
        """Make a state change on every replica and record it (for rebuilds), once at least one applied it.

        If every replica rejects it (bad input: they all agree), nothing
        changes and the first error is raised. If only some applied it, it is
        kept, the others are rebuilt with it (so all replicas stay alike), and
        the first error is raised as :class:`AppliedWithError` (the base then
        records the change) with a note saying so.
        """
        values, errors = self._pool.broadcast_collect("call", method, *args, **kwargs)
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
                self._pool.restart(i, errors[i])
            except Exception as exc:  # lost: the note below still tells the story
                add_note(first, str(exc))
        done = f"Replicas {sorted(values)} applied {method}" + (f" (version {version})" if version is not None else "")
        add_note(
            first, f"{done}; replicas {out_of_step} failed and were rebuilt with it." if out_of_step else f"{done}."
        )
        raise AppliedWithError(first)

    # -- sampling --------------------------------------------------------------------------
    def _chars_per_token(self) -> float:
        if self._tokens < 64:
            return 4.0
        return min(max(self._chars / self._tokens, 1.0), 16.0)

    def _generate(self, prompts: list[InputFeature], params: SamplingParams, adapter_name: str) -> list[SampleResponse]:
        return self._process(list(prompts), params, adapter_name, "raise", None)

    def _process(
        self,
        items: list[Any],
        params: SamplingParams,
        adapter_name: str,
        on_invalid: OnInvalid,
        indices: list[int] | None,
        feed: CallFeed | None = None,
        spec: Any = None,
    ) -> list[SampleResponse]:
        """Split a call across the replicas and gather it in input order (lock held shared by the base).

        Prompt encoding and length checks run in the replicas (each input
        named by its index in this call). Work is balanced by
        ``num_samples x (prompt tokens + max_tokens)``; a conversation's prompt
        tokens are estimated from its text, calibrated on what earlier calls
        measured. Each replica streams its sequences back as they finish
        (``feed`` gets them at once), and the call's stop switch (an
        abort, or a change under ``in_flight="keep"``) stops every replica's
        share. A continuation (``spec``: resume, or ``keep``) goes through the
        base, which calls :meth:`_run`.
        """
        if spec is not None or (feed is not None and feed.aborted):
            return super()._process(items, params, adapter_name, on_invalid, indices, feed, spec)
        self._pool.check_open()

        def on_finish(p: int, s: int, seq: SampledSequence) -> None:
            # a sequence stopped for a "keep" change is continued, and reported then
            if feed is not None and not (seq.stop_reason == "abort" and feed.suspended):
                feed.emit(Finished(p, s, seq))

        stop = feed.start_run() if feed is not None else None
        run = EngineRun(items, params, adapter_name, on_finish=on_finish, stop_event=stop)
        out = self._dispatch(run, items, indices, on_invalid, continuation=False)
        run.report_all(out)
        self._calibrate(items, out)
        return out

    def _run(self, run: EngineRun) -> list[SampleResponse]:
        """A continuation run (the base's ``_process`` calls it): split across the replicas, streamed back."""
        self._pool.check_open()
        return self._dispatch(run, list(run.prompts), None, "raise", continuation=True)

    def _dispatch(
        self,
        run: EngineRun,
        items: list[Any],
        indices: list[int] | None,
        on_invalid: OnInvalid,
        *,
        continuation: bool,
    ) -> list[SampleResponse]:
        """Run ``items`` on the replicas, each share streamed back into ``run`` as its sequences finish.

        Every share runs in its replica's engine as one call
        (``ReplicaHost.stream_shard``); its sequences reach ``run.finish`` as
        they finish there, under their index in ``items``. When ``run``'s stop
        switch is set, every replica's share is stopped. A replica that dies
        is rebuilt and its share run again once (what it had streamed stands:
        ``run.finish`` keeps the first report of each sequence, and so does
        the result). If a share fails, the others are stopped and the first
        failure (in input order) is raised.
        """
        alive = self._pool.alive()
        params = run.params
        cpt = self._chars_per_token()
        costs = [
            0.0 if isinstance(item, Exception) else item_cost(estimate_prompt_tokens(item, cpt), params)
            for item in items
        ]
        shards = [(replica, shard) for replica, shard in zip(alive, split_by_cost(costs, len(alive))) if shard]
        out: list[SampleResponse | None] = [None] * len(items)
        errors: dict[int, BaseException] = {}
        started: list[tuple[int, str]] = []
        started_lock = threading.Lock()
        failed = threading.Event()

        def stop_all() -> None:
            with started_lock:
                targets = list(started)
            for replica, shard_id in targets:
                self._pool.call_nowait(replica, "abort_shard", shard_id)

        def serve(order: int, replica: int, shard: list[int]) -> None:
            named = [k if indices is None else indices[k] for k in shard]
            cont = None
            if continuation:
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
                    self._pool.call_nowait(replica, "abort_shard", shard_id)
                args = (shard_id, [items[k] for k in shard], named, params, run.adapter_name, on_invalid, cont)
                try:
                    responses = self._read_stream(replica, args, shard, run, streamed, failed)
                except _Died as died:
                    if attempt == 1:
                        errors[order] = self._pool.died_twice(died)
                        break
                    try:
                        self._pool.recover(died)
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
        incarnation, stream = self._pool.stream(replica, "stream_shard", *args)
        ray = import_ray()
        while True:
            try:
                ref = next(stream)
            except StopIteration:  # pragma: no cover - the host always ends with the responses
                raise RuntimeError(f"{self._pool.where(replica)} ended a share without its responses.") from None
            except ray.exceptions.RayActorError as exc:
                raise _Died(replica, incarnation, exc) from exc
            value = self._pool.result(replica, incarnation, ref)
            if isinstance(value, list):
                return value
            k, s, seq = value
            if failed.is_set() or (k, s) in streamed:
                continue  # another share failed: the call raises; or already reported before a retry
            streamed[(k, s)] = seq
            run.finish(shard[k], s, seq)

    def _calibrate(self, items: list[Any], out: Sequence[SampleResponse | None]) -> None:
        for item, response in zip(items, out):
            if isinstance(item, Trajectory) and response is not None and response.prompt_token_ids:
                self._chars += trajectory_chars(item)
                self._tokens += len(response.prompt_token_ids)

    # -- lifecycle -------------------------------------------------------------------------
    def _close(self) -> None:
        self._pool.close()
