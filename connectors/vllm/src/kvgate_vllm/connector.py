"""``KvgateConnector``: vLLM's KV connector (``KVConnectorBase_V1``) over kvgate's block manager.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KvgateConnector",
                           "kv_connector_module_path": "kvgate_vllm.connector",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"socket": "/run/kvgate/kvbm.sock"}}'

The scheduler side (``plan.Planner``) looks a waiting request's blocks up in the daemon after its
GPU prefix hit, pinning them, and tells vLLM how many tokens it will load; the worker side loads
them from the daemon into the blocks vLLM allocated before the forward pass (synchronously), and
after each forward offloads the blocks that became full. Both sides hold their own connection
(the scheduler's segment is one block: it only looks up). When the daemon is unreachable the
connector reports no hits and drops offloads; a load that comes back short marks its blocks
failed, and with ``kv_load_failure_policy: recompute`` vLLM computes them instead.

Limits: one KV cache group (no hybrid or sliding-window models); with tensor parallelism each
rank registers its own shard's layout and the scheduler looks up rank 0's.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.metrics.utils import create_metric_per_engine

from .blocks import BlockCopier, pin
from .client import Reconnecting
from .counters import COUNTERS, Counts, merge
from .plan import Planner, Scheduled, Transfer
from .protocol import Layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvgate_vllm")


def _use_vllm_logging() -> None:
    """vLLM configures only its own logger tree; the package's records go to its handlers."""
    ours, theirs = logging.getLogger("kvgate_vllm"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level or logging.INFO)
        ours.propagate = False


_use_vllm_logging()

DEFAULT_SOCKET = "/run/kvgate/kvbm.sock"


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config`` keys (environment variables as fallbacks)."""

    #: The daemon's socket (``KVGATE_KVBM_SOCKET``).
    socket: str = DEFAULT_SOCKET
    #: The model name blocks are keyed under: the daemon's ``--model`` and the router's.
    #: Defaults to the served model name.
    model: str | None = None
    #: How long a lookup pins what it found, ms (the daemon caps it at ``--max-pin-ms``).
    pin_ms: int = 30_000
    #: The worker's staging segment, bytes (rounded down to whole blocks, at least one).
    segment_bytes: int = 256 << 20
    #: Per-request timeout on the socket, s.
    timeout_s: float = 2.0
    #: Wait this long before reconnecting after a failure, s (doubling while failures go on).
    retry_s: float = 1.0
    #: The longest wait between reconnection tries, s.
    max_retry_s: float = 30.0
    #: Page-lock the worker's staging segment with CUDA when the KV cache is on a GPU.
    pin_staging: bool = True

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> Settings:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"kvgate connector: unknown kv_connector_extra_config keys {unknown}; "
                f"known: {sorted(known)}"
            )
        values: dict[str, Any] = {"socket": os.environ.get("KVGATE_KVBM_SOCKET", DEFAULT_SOCKET)}
        values.update(extra)
        s = cls(**values)
        if (
            s.pin_ms < 0
            or s.segment_bytes <= 0
            or s.timeout_s <= 0
            or s.retry_s < 0
            or s.max_retry_s < s.retry_s
        ):
            raise ValueError(f"kvgate connector: invalid settings {s}")
        return s


@dataclass
class KvgateMetadata(KVConnectorMetadata):
    """One step's work for the workers."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


def _served_name(vllm_config: VllmConfig) -> str:
    name = vllm_config.model_config.served_model_name
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name or vllm_config.model_config.model)


def _layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model: str, shard: int) -> Layout:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"kvgate connector: the model has {len(groups)} KV cache groups; "
            "only models with one (full attention in every layer) are supported"
        )
    spec = groups[0].kv_cache_spec
    layers = len(groups[0].layer_names)
    return Layout(
        model=model,
        dtype=str(spec.dtype).removeprefix("torch."),
        layers=layers,
        block_size=vllm_config.cache_config.block_size,
        block_bytes=spec.page_size_bytes * layers,
        shard=shard,
        shards=vllm_config.parallel_config.tensor_parallel_size,
    )


class KvgateStats(KVConnectorStats):
    """The connector's counters on their way to vLLM's logger and Prometheus (``counters``)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvgateStats:
        self.data = merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvgatePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvgate_<counter>_total`` per engine, one per ``counters.COUNTERS``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:kvgate_{name}",
                    documentation=f"kvgate connector: {doc}",
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, n in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and n > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(n)


class KvgateConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._settings = Settings.parse(dict(self._kv_transfer_config.kv_connector_extra_config))
        self._model = self._settings.model or _served_name(vllm_config)
        self._block_size = vllm_config.cache_config.block_size
        self._stats = Counts()
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning(
                "kvgate connector: kv_load_failure_policy is %r; a block the daemon loses "
                "between lookup and load then fails the request. Set it to \"recompute\".",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        self._client: Reconnecting | None = None
        self._planner: Planner | None = None
        self._copier: BlockCopier | None = None
        self._staging: torch.Tensor | None = None
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            layout = _layout(vllm_config, kv_cache_config, self._model, 0)
            self._layout = layout
            self._planner = Planner(self._block_size)
            self._client = self._connect(layout, layout.block_bytes)
            log.info("kvgate connector (scheduler): model %r, layout %s", self._model, layout)

    def _connect(self, layout: Layout, segment_bytes: int) -> Reconnecting:
        s = self._settings
        return Reconnecting(
            s.socket, layout, segment_bytes, s.timeout_s, s.retry_s, max_retry_s=s.max_retry_s
        )

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._planner is not None and self._client is not None
        client, pin_ms = self._client, self._settings.pin_ms
        lora = getattr(request, "lora_request", None)
        model = lora.lora_name if lora is not None else self._model
        stats = self._stats

        def lookup(keys: list[int]):
            found = client.call(lambda c: c.lookup(keys, pin_ms))
            stats.add("lookups")
            if found is None:
                stats.add("lookups_failed")
            return found

        n = self._planner.match(
            request.request_id,
            model,
            request.all_token_ids,
            getattr(request, "cache_salt", None),
            num_computed_tokens,
            lookup,
        )
        return n, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._planner is not None
        self._planner.allocated(request.request_id, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        assert self._planner is not None
        host, lower = self._planner.hit_sources(request.request_id, num_external_tokens)
        out = {CacheHitSource.HOST: host, CacheHitSource.EXTERNAL_UNSPECIFIED: lower}
        return {k: v for k, v in out.items() if v}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._planner is not None and self._client is not None
        sched = scheduler_output.num_scheduled_tokens
        manager = self._kv_cache_manager
        steps: list[Scheduled] = []
        for new in scheduler_output.scheduled_new_reqs:
            steps.append(
                Scheduled(
                    new.req_id,
                    new.num_computed_tokens,
                    sched.get(new.req_id, 0),
                    lambda ids=new.block_ids[0]: ids,
                )
            )
        cached = scheduler_output.scheduled_cached_reqs
        if manager is not None:
            for i, req_id in enumerate(cached.req_ids):
                steps.append(
                    Scheduled(
                        req_id,
                        cached.num_computed_tokens[i],
                        sched.get(req_id, 0),
                        lambda req_id=req_id: manager.get_block_ids(req_id)[0],
                    )
                )
        loads, saves, unpins = self._planner.step(steps)
        for keys in unpins:
            self._client.call(lambda c, keys=keys: c.unpin(keys))
        return KvgateMetadata(loads, saves)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._planner is not None and self._client is not None:
            for keys in self._planner.finished(request.request_id):
                self._client.call(lambda c, keys=keys: c.unpin(keys))
        return False, None

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        layout = _layout(
            self._vllm_config, self._kv_cache_config, self._model, get_tensor_model_parallel_rank()
        )
        names = self._kv_cache_config.kv_cache_groups[0].layer_names
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ValueError(f"kvgate connector: no KV tensors for layers {missing}")
        self._copier = BlockCopier(
            [kv_caches[n] for n in names], self._kv_cache_config.num_blocks, layout.block_bytes
        )
        slots = max(1, self._settings.segment_bytes // layout.block_bytes)
        self._client = self._connect(layout, slots * layout.block_bytes)
        self._staging = torch.frombuffer(self._client.segment.map, dtype=torch.uint8)
        self._slots = slots
        pinned = self._settings.pin_staging and pin(self._staging, self._copier.device)
        log.info(
            "kvgate connector (worker): %d layers, %d bytes per block, %d staging slots%s, socket %s",
            layout.layers,
            layout.block_bytes,
            slots,
            " (page-locked)" if pinned else "",
            self._settings.socket,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvgateMetadata)
        for t in meta.loads:
            self._load(t)

    def _load(self, t: Transfer) -> None:
        assert self._client is not None and self._copier is not None and self._staging is not None
        bb, copier, staging = self._client.layout.block_bytes, self._copier, self._staging
        for start in range(0, len(t.keys), self._slots):
            keys = t.keys[start : start + self._slots]
            ids = t.block_ids[start : start + self._slots]
            got = self._client.call(lambda c: c.onboard([(k, i * bb) for i, k in enumerate(keys)]))
            n = got.blocks if got is not None else 0
            copier.scatter(staging, ids[:n])
            self._stats.add("loaded_blocks", n)
            if got is not None:
                self._stats.add("loaded_from_disk_blocks", got.from_disk)
                self._stats.add("loaded_from_remote_blocks", got.from_remote)
                self._stats.add("loaded_from_peer_blocks", got.from_peer)
            if n < len(keys):
                failed = t.block_ids[start + n :]
                self._load_errors.update(failed)
                self._stats.add("load_failed_blocks", len(failed))
                log.warning(
                    "kvgate connector: request %s: %d of %d blocks could not be loaded; "
                    "they are recomputed",
                    t.req_id,
                    len(failed),
                    len(t.keys),
                )
                return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata() or self._client is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvgateMetadata)
        for t in meta.saves:
            self._save(t)

    def _save(self, t: Transfer) -> None:
        assert self._client is not None and self._copier is not None and self._staging is not None
        bb, parent = self._client.layout.block_bytes, t.parent
        for start in range(0, len(t.keys), self._slots):
            keys = t.keys[start : start + self._slots]
            self._copier.gather(t.block_ids[start : start + self._slots], self._staging)
            slots = [(k, i * bb) for i, k in enumerate(keys)]
            done = self._client.call(lambda c, p=parent: c.offload(p, slots))
            if done is None:
                self._stats.add("offload_dropped_blocks", len(t.keys) - start)
                return
            self._stats.add("offloaded_blocks", done.stored)
            self._stats.add("offload_skipped_blocks", done.skipped)
            parent = keys[-1]

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        delta = self._stats.take()
        return KvgateStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvgateStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KvgatePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


__all__ = ["KvgateConnector", "KvgateMetadata", "Settings"]
