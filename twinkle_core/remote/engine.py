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

import attrs

from twinkle_core.adapter_input import AdapterInput
from twinkle_core.data_format import SampleResponse, SamplingParams
from twinkle_core.engine import Engine, EngineContext, EngineInfo, EngineRun
from twinkle_core.errors import ConfigError, WeightUpdateError
from twinkle_core.mesh import DeviceGroup, DeviceMesh
from twinkle_core.names import trainer_spelling
from twinkle_core.remote._balance import item_cost, split_by_cost
from twinkle_core.remote._host import ReplayCopies
from twinkle_core.remote._media import restore_prompt_media
from twinkle_core.remote._pool import Op, ReplicaPool, _Died, add_note
from twinkle_core.remote._runtime import PlacedGroup, import_ray
from twinkle_core.remote.errors import ReplicaLostError
from twinkle_core.remote.remote_class import held_engine
from twinkle_core.sampler.policy import AppliedWithError
from twinkle_core.transport import CollectiveOptions, TransportSetting, resolve_transport

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
        weight_transport: TransportSetting = None,
    ) -> None:
        super().__init__(context)
        #: ``"object_store"``, or the collective's options (see :mod:`twinkle_core.transport`).
        self.weight_transport: str | CollectiveOptions = resolve_transport(weight_transport)
        self.engine_class = engine_class
        self.device_mesh = mesh
        self.group: DeviceGroup = placed.group
        # ``Sampler(SomeEngine, ...)``: the engine object's class names it.
        self.label = (held_engine(engine_class, args) or engine_class).__name__
        # version -> (ref of the update's tensors, or replicas' copies of it; names still current from it)
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
            on_replayed=self._add_copies,
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
                streams_weights=isinstance(self.weight_transport, CollectiveOptions),
                weights_dtype=info.get("weights_dtype"),
                media=frozenset(info.get("media", ())),
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

    def set_weight_transport(self, setting: TransportSetting) -> None:
        """Choose how later updates reach the replicas (see :mod:`twinkle_core.transport`)."""
        self.weight_transport = resolve_transport(setting)
        self.info = attrs.evolve(self.info, streams_weights=isinstance(self.weight_transport, CollectiveOptions))

    def _add_copies(self, kept: dict[str, Any]) -> None:
        """A rebuilt replica holds copies of collective updates now too: list them for later rebuilds."""
        for source, _names in list(self._weight_ops.values()):
            if isinstance(source, ReplayCopies) and source.key in kept:
                source.refs.append(kept[source.key])

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
        if adapter.folder is None and isinstance(self.weight_transport, CollectiveOptions):

            def record_adapter(copies: ReplayCopies, _names: set[str]) -> None:
                self._adapter_ops[name] = (version, source, copies, kwargs)

            call_kwargs = {"version": version, "check_finite": False, **kwargs}
            self._collective(
                adapter.tensors,
                "add_adapter_to_model",
                (name, source),
                call_kwargs,
                self.weight_transport,
                record_adapter,
            )
            return adapter.source
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

    def update_weights(self, named_tensors: Any, *, version: int) -> None:
        """Replace base weights on every replica, with the one new version they all carry.

        With the object store (the default), the tensors are put there once
        and every replica reads that copy; the driver keeps the ref so a
        rebuilt replica gets the same weights. With the collective transport
        they stream down a chain of the replicas (:meth:`_collective`)
        and each replica keeps its own copy for rebuilds. Either way, for each
        tensor name only the latest update holding it is kept: superseded
        updates are released.
        """
        if isinstance(self.weight_transport, CollectiveOptions):
            self._collective(
                named_tensors,
                "update_weights",
                (),
                {"version": version, "check_finite": False},
                self.weight_transport,
                lambda copies, names: self._record_weights(version, copies, names),
            )
            return
        ref = import_ray().put(named_tensors)
        self._apply(
            "update_weights",
            (ref,),
            {"version": version, "check_finite": False},
            record=lambda: self._record_weights(version, ref, {name for name, _ in named_tensors}),
        )

    def _record_weights(self, version: int, source: Any, names: set[str]) -> None:
        # by the trainer's spelling: a push of model.language_model.* supersedes one of model.*
        names = {trainer_spelling(name) for name in names}
        for old_version in list(self._weight_ops):
            _old, old_names = self._weight_ops[old_version]
            old_names -= names
            if not old_names:
                del self._weight_ops[old_version]
        self._weight_ops[version] = (source, set(names))

    def _collective(
        self,
        named_tensors: Any,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: CollectiveOptions,
        record: Callable[[ReplayCopies, set[str]], None],
    ) -> None:
        """Stream tensors from here down a chain of every replica in service, each applying ``method`` with them.

        ``method``: ``"update_weights"`` or ``"add_adapter_to_model"``
        (``args``/``kwargs`` are the rest of its arguments); ``record`` keeps
        the change (its replicas' copies, the names it held) for rebuilds.

        * Before any tensor is read, every replica must join. One that died is
          rebuilt (with the state before this update) and the group is formed
          again, once; one that does not join in time is a
          :class:`~twinkle_core.errors.WeightSyncTimeoutError`. Nothing changed.
        * A replica applies the update only once it has all of it, checksums
          right, and keeps a copy in its node's object store for rebuilds.
        * If some replicas applied it and others did not (one died; the chain
          broke after it), the others take it from a finished replica's copy,
          or are rebuilt. If none applied it, nothing changed: a list is sent
          again once after rebuilding the dead; a one-shot stream cannot be
          read twice, so the error is raised, the version unchanged.
        """
        from twinkle_core.transport.collective import Sender

        reusable = isinstance(named_tensors, (list, tuple))
        names: set[str] = set()

        def noted(pairs: Any) -> Any:
            for name, tensor in pairs:
                names.add(name)
                yield name, tensor

        stream = noted(named_tensors)
        for attempt in range(2):
            self.pool.check_open()
            alive = self.pool.alive()
            sender = Sender(
                len(alive) + 1,
                host=options.address(),
                backend=options.backend,
                timeout_s=options.timeout(),
                bucket_bytes=options.bucket_bytes,
                chunk_bytes=options.chunk_bytes,
            )
            try:
                calls = {
                    i: self.pool.submit(i, "receive_weights", sender.spec, rank, method, args, kwargs)
                    for rank, i in enumerate(alive, 1)
                }
                if not self._join(sender, calls):
                    continue  # a replica died before anything was read; it is rebuilt: form the group again
                send_error: BaseException | None = None
                try:
                    sender.send(stream if attempt == 0 or not reusable else noted(named_tensors))
                except Exception as exc:
                    send_error = exc
                values, errors = self._collect(calls)
            finally:
                sender.close()
            if values:
                copies = ReplayCopies([values[i]["copy"][0] for i in sorted(values)])
                record(copies, names)
                self._repair(errors, copies, method, args, kwargs)
                return
            dead = [i for i, e in errors.items() if isinstance(e, _Died)]
            error = send_error or self._first_error(errors)
            for i in dead:
                self._recover_quietly(errors, i)
            if reusable and dead and attempt == 0:
                continue
            if dead:
                lost = [i for i in dead if isinstance(errors[i], ReplicaLostError)]
                add_note(
                    error,
                    f"Replicas {dead} died during the update; nothing changed (the version too)."
                    + (f" Replicas {lost} could not be rebuilt." if lost else " They were rebuilt."),
                )
            raise error
        raise ReplicaLostError(
            f"Replicas of {self.label} died twice while joining a weight update; nothing changed.",
            replica=-1,
            survivors=len(self.pool.alive()),
        )

    def _join(self, sender: Any, calls: dict[int, tuple[int, Any]]) -> bool:
        """Wait until every replica joined; False if one died first (it is rebuilt), else raise why one ended."""
        ray = import_ray()
        refs = [ref for _inc, ref in calls.values()]

        class _EndedEarly(Exception):
            pass

        def watch() -> None:
            if ray.wait(refs, num_returns=1, timeout=0)[0]:
                raise _EndedEarly

        try:
            sender.wait_joined(watch)
        except _EndedEarly:  # a receive ended before it joined: it died or failed; the rest were told to give up
            _values, errors = self._collect(calls)
            dead = [i for i, e in errors.items() if isinstance(e, _Died)]
            for i in dead:
                self._recover_quietly(errors, i)
            if dead:
                return False
            raise self._first_error(errors) from None
        except BaseException:
            self._collect(calls, timeout=5.0)  # those that joined were told to give up; a stuck one is left
            raise
        return True

    def _collect(
        self, calls: dict[int, tuple[int, Any]], timeout: float | None = None
    ) -> tuple[dict[int, Any], dict[int, BaseException]]:
        """The replicas' answers to ``receive_weights``: who applied it, and the errors (``_Died``: a death)."""
        ray = import_ray()
        if timeout is not None:
            ray.wait([ref for _inc, ref in calls.values()], num_returns=len(calls), timeout=timeout)
        values: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        for i, (incarnation, ref) in calls.items():
            if timeout is not None and not ray.wait([ref], timeout=0)[0]:
                continue
            try:
                value = self.pool.result(i, incarnation, ref)
            except _Died as died:
                errors[i] = died
                continue
            except Exception as exc:
                errors[i] = exc
                continue
            if "aborted" in value:
                errors[i] = WeightUpdateError(f"Replica {i} dropped the weight update: {value['aborted']}.")
            else:
                values[i] = value
        return values, errors

    @staticmethod
    def _first_error(errors: dict[int, BaseException]) -> BaseException:
        first = errors[min(errors)]
        return first.cause if isinstance(first, _Died) else first

    def _recover_quietly(self, errors: dict[int, BaseException], index: int) -> None:
        """Rebuild a replica that died (its replay holds what is recorded); a lost one's error replaces its entry."""
        died = errors[index]
        assert isinstance(died, _Died)
        try:
            self.pool.recover(died)
        except ReplicaLostError as lost:
            errors[index] = lost

    def _repair(
        self,
        errors: dict[int, BaseException],
        copies: ReplayCopies,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Bring the replicas that missed an update the others applied up to date.

        A dead one is rebuilt (its replay now holds the update); one that
        missed the stream takes it from ``copies`` (finished replicas') and keeps one too.
        Like :meth:`_apply`, an engine that refuses what the others took is
        rebuilt with it and the error is raised as :class:`AppliedWithError`.
        """
        refused: list[int] = []
        first: BaseException | None = None
        for i, error in sorted(errors.items()):
            if isinstance(error, _Died):
                self._recover_quietly(errors, i)
                continue
            try:
                copies.refs += self.pool.run(i, "apply_copy", copies, method, args, kwargs)
            except Exception as exc:
                first = first or exc
                refused.append(i)
                try:
                    self.pool.restart(i, exc)
                except Exception as lost:
                    add_note(exc, str(lost))
        if first is not None:
            add_note(
                first,
                f"Replicas applied {method} (version {kwargs.get('version')}); replicas {refused} failed and were"
                " rebuilt with it.",
            )
            raise AppliedWithError(first)

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
    def run(self, run: EngineRun) -> None:
        """Run ``run``'s prompts on the replicas, each share streamed back into ``run`` as its sequences finish.

        Every share runs in its replica as one call (``ReplicaHost.stream_shard``,
        which continues each prompt from ``run.generated`` with ``run.sample_base``
        and ``run.max_tokens``); its sequences reach ``run.finish`` as they
        finish there. When ``run``'s stop switch is set, every replica's share
        is stopped. A replica that dies is rebuilt and its share run again once
        (what it had streamed stands: ``run.finish`` keeps the first report of
        each sequence). Each sequence crosses from its replica once; a share
        ends with its prompts' scores. If a share fails, the others are
        stopped and the first failure (in input order) is raised.
        """
        self.pool.check_open()
        prompts, params = run.prompts, run.params
        alive = self.pool.alive()
        costs = [
            item_cost(len(p.input_ids), params.replace(max_tokens=budget)) for p, budget in zip(prompts, run.max_tokens)
        ]
        shards = [(replica, shard) for replica, shard in zip(alive, split_by_cost(costs, len(alive))) if shard]
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
            streamed: set[tuple[int, int]] = set()  # reported already (a retried share skips them)
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
                for k, response in zip(shard, responses):
                    if response.prompt_logprobs is not None:
                        run.report_scores(k, response.prompt_logprobs, response.prompt_top_logprobs)
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

    def _read_stream(
        self,
        replica: int,
        args: tuple[Any, ...],
        shard: list[int],
        run: EngineRun,
        streamed: set[tuple[int, int]],
        failed: threading.Event,
    ) -> list[SampleResponse]:
        """Read one share's stream: report each sequence to ``run``; return the share's responses, without sequences."""
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
            k, s, seq, shed = value
            if failed.is_set() or (k, s) in streamed:
                continue  # another share failed: the call raises; or already reported before a retry
            streamed.add((k, s))
            run.finish(shard[k], s, restore_prompt_media(seq, run.prompts[shard[k]]) if shed else seq)

    # -- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        self.pool.close()
