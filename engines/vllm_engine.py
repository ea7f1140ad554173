"""The vLLM engine: one ``AsyncLLM`` behind ``engines.base.Engine``.

Prefix caching and ZMQ KV events are always on. The publisher binds a free port on every
interface (vLLM binds only endpoints with ``*``) and its replay ROUTER a free port on loopback;
``kv_events_endpoint``/``kv_events_replay_endpoint`` give the loopback addresses the forwarder in
the same replica connects to. Load comes from inside vLLM's engine core: kvroute's scheduler
(``engines.vllm_scheduler``) publishes a ``CoreReport`` every step and on a heartbeat when idle,
on a loopback socket beside the KV events (``load_report_endpoint``); ``engines.vllm_load`` says
what stands in for it before the first report or with ``core_report=False``.

A CPU KV tier (``cpu_tier``) runs vLLM's ``OffloadingConnector`` with a kvroute policy
(``engines.offload``), composed with any other connector (``kv_transfer_config``, e.g. the PD
connector) through ``MultiConnector``; vLLM refuses it on its CPU build.

Any script that starts one needs an ``if __name__ == "__main__"`` guard: vLLM spawns its engine
core process. That process, and its workers, end when the one hosting the engine dies, even by
SIGKILL (``engines.vllm_watchdog``).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

from engines import core_report, offload, vllm_watchdog
from engines.base import (
    Engine,
    EngineError,
    EngineOutput,
    EngineRequest,
    LoadSnapshot,
    SamplingParams,
    TopLogprob,
    Usage,
    refusal,
)
from engines.config import CpuTierConfig
from engines.environ import scoped_environ
from engines.ports import free_port
from engines.vllm_load import InFlight, VllmLoad

log = logging.getLogger(__name__)
_FINISH_REASONS = {"stop", "length", "abort", "error"}


# OpenAI's defaults of the sampling knobs (what vLLM's server uses where the model's generation
# config sets none)
OPENAI_KNOB_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}


def _amx_cpu_attention() -> bool:
    """vLLM runs its CPU attention's AMX kernels here: the CPU platform on a CPU with AMX tiles
    (vLLM's own test, ``cpu_attn._get_attn_isa``; bf16 caches in blocks of 32, as ours are)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


class VllmEngine(Engine):
    """One vLLM ``AsyncLLM``.

    ``kv_space_gib`` sets ``VLLM_CPU_KVCACHE_SPACE`` (CPU build; whole GiB); ``kv_blocks`` caps
    the KV cache at that many blocks (vLLM's ``num_gpu_blocks_override``), for small-cache tests.
    ``block_size`` must be a multiple of 32 on the CPU backend. ``cpu_threads_bind`` sets
    ``VLLM_CPU_OMP_THREADS_BIND`` (CPU build: the cores its worker's OpenMP threads use, e.g.
    ``"1"`` or ``"0-3"``; None keeps vLLM's ``auto``, which binds every engine on a node to the
    same cores).

    ``cpu_tier`` adds a CPU KV tier: vLLM's ``OffloadingConnector`` with the tier's kvroute
    policy, in chunks of ``cpu_chunk_blocks`` GPU blocks (GPU build only).
    ``kv_transfer_config`` is another connector's vLLM ``kv_transfer_config`` (a dict, e.g. the
    PD connector's); with a CPU tier too, both run through ``MultiConnector``, that one first.
    ``core_report``: run kvroute's scheduler, which reports load from the engine core (on by
    default; an ``extra_engine_args`` ``scheduler_cls`` turns it off).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        instance_id: str,
        *,
        block_size: int = 32,
        kv_space_gib: int | None = 1,
        kv_blocks: int | None = None,
        max_model_len: int = 4096,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        long_prefill_token_threshold: int | None = None,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        served_model_name: str | None = None,
        cpu_threads_bind: str | None = None,
        cpu_tier: CpuTierConfig | None = None,
        cpu_chunk_blocks: int = 1,
        kv_transfer_config: dict[str, Any] | None = None,
        extra_engine_args: dict[str, Any] | None = None,
        core_report: bool = True,
    ) -> None:
        if block_size <= 0 or block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {block_size}")
        if kv_space_gib is not None and kv_space_gib < 1:
            raise ValueError(f"kv_space_gib must be >= 1 (whole GiB), got {kv_space_gib}")
        if cpu_chunk_blocks < 1:
            raise ValueError(f"cpu_chunk_blocks must be >= 1, got {cpu_chunk_blocks}")
        self.cpu_tier = cpu_tier
        self.cpu_chunk_blocks = cpu_chunk_blocks
        self._other_connector = dict(kv_transfer_config) if kv_transfer_config else None
        self.model = str(model)
        self.instance_id = instance_id
        self.block_size = block_size
        self.served_model_name = served_model_name or self.model
        self._kv_space_gib = kv_space_gib
        self._cpu_threads_bind = cpu_threads_bind
        self._args: dict[str, Any] = dict(
            model=self.model,
            served_model_name=self.served_model_name,
            block_size=block_size,
            enable_prefix_caching=True,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold or 0,
            tensor_parallel_size=tensor_parallel_size,
            num_gpu_blocks_override=kv_blocks,
            seed=seed,
            enforce_eager=True,
            **(extra_engine_args or {}),
        )
        self._llm: Any = None
        self._core_report = core_report and "scheduler_cls" not in self._args
        self._report_port = 0
        self._pub_port = 0
        self._replay_port = 0
        # the load it reports (``engines.vllm_load``), and its requests in flight
        self._load = VllmLoad(instance_id)
        self._inflight = self._load.inflight
        # files the engine core reads its connectors' settings from (``mooncake_store_env``),
        # kept while the engine runs
        self._scratch: tempfile.TemporaryDirectory[str] | None = None
        self.num_gpu_blocks: int | None = None
        # the sampling knobs a request leaves unset: the model's generation config over
        # OpenAI's defaults (set by ``start``)
        self.knob_defaults: dict[str, Any] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._llm is not None:
            return
        from vllm import AsyncEngineArgs
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.v1.engine.async_llm import AsyncLLM

        if self._kv_space_gib is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self._kv_space_gib)
        if self._cpu_threads_bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self._cpu_threads_bind
        transfer = self.connector_config()
        if self.cpu_tier is not None:
            from vllm.platforms import current_platform

            if not (current_platform.is_cuda_alike() or current_platform.is_xpu()):
                raise EngineError(
                    f"vLLM engine {self.instance_id}: cpu_tier needs vLLM's offloading connector, "
                    "which runs only on CUDA-alike and XPU GPUs"
                )
            # NOTE: the engine core process inherits this: the policy's only way to its options.
            os.environ.update(offload.policy_options_env(self.cpu_tier))
        self._pub_port, self._replay_port = free_port(), free_port()
        events = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{self._pub_port}",
            replay_endpoint=f"tcp://127.0.0.1:{self._replay_port}",
            topic="kv-events",
        )
        env: dict[str, str] = {}
        scheduler: dict[str, str] = {}
        if self._core_report:  # the engine core binds it; this reader and the forwarder's join
            from engines.vllm_scheduler import SCHEDULER_QUALNAME

            self._report_port = free_port()
            env[core_report.ENDPOINT_ENV] = f"tcp://127.0.0.1:{self._report_port}"
            scheduler["scheduler_cls"] = SCHEDULER_QUALNAME
            self._load.reports = core_report.CoreReportReader(env[core_report.ENDPOINT_ENV])
        args = AsyncEngineArgs(
            kv_events_config=events,
            kv_transfer_config=KVTransferConfig(**transfer) if transfer else None,
            **self._args,
            **scheduler,
        )
        from engines.pd.nixl import side_channel_env
        from engines.pool.connector import mooncake_store_env

        # NOTE: vLLM loads it as a plugin too; here it also holds where VLLM_PLUGINS leaves it out
        # (a forked engine core: a spawned one has only the plugin)
        vllm_watchdog.install()

        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="kvroute-vllm-")
        try:
            # NOTE: vLLM's NixlConnector reads its side channel, and its MooncakeStoreConnector
            # its store's settings file, from the environment only; the engine core process
            # inherits it (nothing is set for other connectors)
            env.update(side_channel_env(self._other_connector or {}))
            env.update(mooncake_store_env(transfer or {}, self._scratch.name))
            with scoped_environ(env):
                self._llm = AsyncLLM.from_engine_args(
                    args, stat_loggers=[self._stat_logger_factory]
                )
        except Exception as e:
            raise EngineError(f"vLLM engine {self.instance_id} failed to start: {e}") from e
        self.num_gpu_blocks = self._llm.vllm_config.cache_config.num_gpu_blocks
        # NOTE: vLLM reads the generation config from disk on every call: once per engine.
        try:
            model_defaults = dict(self._llm.model_config.get_diff_sampling_param())
        except Exception as e:  # no readable generation config: OpenAI's defaults
            log.debug("engine %s: no generation-config defaults: %s", self.instance_id, e)
            model_defaults = {}
        self.knob_defaults = {
            name: model_defaults.get(name, default)
            for name, default in OPENAI_KNOB_DEFAULTS.items()
        }
        if self._other_connector is not None and _amx_cpu_attention():
            await self._warm_up_attention()
        log.info(
            "vLLM engine %s up: %s blocks of %d tokens, KV events on %s",
            self.instance_id,
            self.num_gpu_blocks,
            self.block_size,
            self.kv_events_endpoint,
        )

    async def stop(self) -> None:
        llm, self._llm = self._llm, None
        if llm is None:
            return
        if self._inflight:
            await llm.abort(list(self._inflight))
        llm.shutdown()
        self._inflight.clear()
        self._load.close()
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    def connector_config(self) -> dict[str, Any] | None:
        """The ``kv_transfer_config`` this engine gives vLLM (None: no connector). Sizing a tier
        given in ``blocks`` reads the model's config (``kv_bytes_per_token``)."""
        tier = self.cpu_tier
        per_token = None
        if tier is not None and tier.blocks is not None:
            per_token = self.kv_bytes_per_token()
        return offload.kv_transfer_config(
            tier,
            self.block_size,
            kv_bytes_per_token=per_token,
            blocks_per_chunk=self.cpu_chunk_blocks,
            other=self._other_connector,
        )

    def kv_bytes_per_token(self) -> int:
        """KV bytes per token of the whole model, from vLLM's view of its config (no start)."""
        from vllm import AsyncEngineArgs

        mc = AsyncEngineArgs(**self._args).create_model_config()
        return _kv_bytes_per_token(mc, mc.get_total_num_hidden_layers(), self._args)

    async def clear_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: the GPU prefix cache first (refused while requests
        hold blocks: False, nothing changed), then the connectors' caches with it (the CPU tier;
        vLLM publishes no CPU removals for that). vLLM publishes KV events only when it steps, so
        a one-token request follows to publish ``AllBlocksCleared`` now."""
        llm = self._llm
        if llm is None:
            raise EngineError(f"engine {self.instance_id} is not running")
        try:
            if not await llm.reset_prefix_cache():
                return False
            connectors = self._other_connector is not None or self.cpu_tier is not None
            if connectors and not await llm.reset_prefix_cache(reset_connector=True):
                return False
            await self._step_once()
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"engine {self.instance_id} could not clear its cache: {e}") from e
        return True

    async def _step_once(self) -> None:
        """Run one one-token request (no full block: no KV event of its own), so vLLM steps
        and publishes the KV events it queued while idle."""
        await self._run_once([0], 1, "step")

    async def _run_once(self, token_ids: list[int], max_tokens: int, tag: str) -> None:
        """Run a request of kvroute's own (greedy, to ``max_tokens``) and drop its output."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = VllmSamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        request_id = f"kvroute-{tag}-{time.monotonic_ns()}"
        prompt = TokensPrompt(prompt_token_ids=token_ids)
        async for _ in self._llm.generate(prompt, params, request_id):
            pass

    async def _warm_up_attention(self) -> None:
        """Prefill a few blocks once, then clear them from the cache (and the router's map:
        their ``BlockStored`` and the ``AllBlocksCleared`` reach the bus in order).

        NOTE: on an AMX CPU (Sapphire or Emerald Rapids) vLLM 0.32's CPU attention runs its
        "amx" kernels having checked only the CPU's flag (``torch.cpu._is_amx_tile_supported``),
        but Linux lets a process use AMX only once it asked (``arch_prctl``, which
        ``torch.cpu._init_amx`` does). oneDNN asks at its first AMX matmul, which a prefill runs;
        a decode engine's first request is a decode step over pulled KV, and its worker died of
        an illegal instruction (every PD engine test here, an Emerald Rapids VM, with kvroute's
        connector and NIXL alike). A prefill first, or ``_init_amx`` in every vLLM process, and
        they pass; this is the one that needs no hook in vLLM's processes."""
        n = min(4 * self.block_size, int(self._args["max_model_len"]) - 2)
        await self._run_once([1 + i % 100 for i in range(n)], 2, "warmup")
        if not await self.clear_cache():
            log.warning("engine %s: its warm-up prompt stays cached", self.instance_id)

    def _stat_logger_factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        """The stat logger vLLM builds in the front end (``VllmLoad``'s; a subclass may wrap
        it to see the scheduler's stats too)."""
        return self._load.stat_logger_factory(vllm_config, engine_index)

    # -- requests ----------------------------------------------------------------------------

    def _sampling(self, request: EngineRequest) -> Any:
        """vLLM's ``SamplingParams`` for ``request``: every field of ours under its vLLM name;
        distribution knobs left unset take the model's generation config (vLLM's OpenAI server's
        rule), then OpenAI's defaults. Raises ``ValueError`` (vLLM's validation) if invalid."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        s: SamplingParams = request.sampling
        extra = dict(s.extra_args) if s.extra_args else {}
        if request.kv_transfer_params is not None:
            extra["kv_transfer_params"] = dict(request.kv_transfer_params)
        defaults = self.knob_defaults or OPENAI_KNOB_DEFAULTS
        knobs = {
            name: value if (value := getattr(s, name)) is not None else default
            for name, default in defaults.items()
        }
        return VllmSamplingParams.from_optional(
            **knobs,
            max_tokens=s.max_tokens,
            seed=s.seed,
            stop=list(s.stop),
            stop_token_ids=list(s.stop_token_ids),
            include_stop_str_in_output=s.include_stop_str_in_output,
            ignore_eos=s.ignore_eos,
            min_tokens=s.min_tokens,
            logprobs=s.logprobs if not s.logprob_token_ids else None,
            logprob_token_ids=list(s.logprob_token_ids) if s.logprob_token_ids else None,
            logit_bias=dict(s.logit_bias) if s.logit_bias else None,
            allowed_token_ids=list(s.allowed_token_ids) if s.allowed_token_ids else None,
            bad_words=list(s.bad_words),
            skip_special_tokens=s.skip_special_tokens,
            spaces_between_special_tokens=s.spaces_between_special_tokens,
            structured_outputs=StructuredOutputsParams(**s.structured_outputs)
            if s.structured_outputs
            else None,
            stream_interval=s.stream_interval,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra or None,
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        llm = self._llm
        if llm is None:
            raise EngineError(f"engine {self.instance_id} is not running")
        if request.lora_name is not None:
            raise ValueError(f"lora_name {request.lora_name!r}: no LoRA adapters are loaded")
        if request.request_id in self._inflight:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        n = len(request.prompt_token_ids)
        st = self._inflight[request.request_id] = InFlight(
            n, min(max(request.expected_cached_tokens, 0), n - 1)
        )
        completion = 0
        first_at = 0.0  # when its first token came (time.monotonic(); 0: not yet)
        try:
            from vllm.exceptions import VLLMClientError

            try:
                params = self._sampling(request)
            except (ValueError, VLLMClientError) as e:
                yield refusal(request.request_id, n, e)
                return
            stream = llm.generate(prompt, params, request.request_id)
            try:
                while True:
                    try:
                        out = await anext(stream)
                    except StopAsyncIteration:
                        break
                    except (ValueError, VLLMClientError) as e:
                        if st.started:
                            raise EngineError(f"request {request.request_id} failed: {e}") from e
                        # vLLM's own request validation (vocabulary, structured-output grammar ...)
                        yield refusal(request.request_id, n, e)
                        return
                    c = out.outputs[0] if out.outputs else None
                    ids = list(c.token_ids) if c is not None else []
                    if ids and not first_at:
                        first_at = time.monotonic()
                    completion += len(ids)
                    st.started, st.generated = True, completion
                    reason = c.finish_reason if c is not None else None
                    if out.finished and reason not in _FINISH_REASONS:
                        reason = "stop"
                    if out.finished and (out.num_cached_tokens or 0) + self.block_size < (
                        st.expected_cached
                    ):
                        log.info(
                            "engine %s: request %s found %d cached tokens, the router expected %d",
                            self.instance_id,
                            request.request_id,
                            out.num_cached_tokens or 0,
                            st.expected_cached,
                        )
                    yield EngineOutput(
                        request_id=request.request_id,
                        token_ids=ids,
                        text=c.text if c is not None else None,
                        finished=out.finished,
                        finish_reason=reason if out.finished else None,
                        usage=Usage(st.prompt_tokens, completion, out.num_cached_tokens or 0)
                        if out.finished
                        else None,
                        kv_transfer_params=out.kv_transfer_params if out.finished else None,
                        logprobs=_logprobs(c.logprobs, len(ids)) if c is not None else None,
                        stop_reason=c.stop_reason if c is not None and out.finished else None,
                        first_token_age_s=time.monotonic() - first_at
                        if out.finished and first_at
                        else None,
                    )
            finally:
                await stream.aclose()  # an early close aborts the request in vLLM
        except (ValueError, EngineError):
            raise
        except Exception as e:
            from vllm.v1.engine.exceptions import EngineDeadError

            if isinstance(e, EngineDeadError):
                raise EngineError(f"engine {self.instance_id} is dead: {e}") from e
            raise EngineError(f"request {request.request_id} failed: {e}") from e
        finally:
            self._inflight.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    # -- load and health ---------------------------------------------------------------------

    def load(self) -> LoadSnapshot:
        return self._load.snapshot()

    async def check_health(self) -> None:
        llm = self._llm
        if llm is None:
            raise EngineError(f"engine {self.instance_id} is not running")
        try:
            await llm.check_health()
        except Exception as e:
            raise EngineError(f"engine {self.instance_id} is unhealthy: {e}") from e

    @property
    def kv_events_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self._pub_port}" if self._pub_port else None

    @property
    def kv_events_replay_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self._replay_port}" if self._replay_port else None

    @property
    def load_report_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self._report_port}" if self._report_port else None

    def engine_info(self) -> dict[str, int]:
        """The limits vLLM resolved at start (KV blocks, batching, lengths, KV bytes/token)."""
        if self._llm is None:
            raise EngineError(f"engine {self.instance_id} is not running")
        vc = self._llm.vllm_config
        mc = vc.model_config
        return {
            "num_gpu_blocks": int(vc.cache_config.num_gpu_blocks or 0),
            "max_num_batched_tokens": int(vc.scheduler_config.max_num_batched_tokens),
            "max_num_seqs": int(vc.scheduler_config.max_num_seqs),
            "max_model_len": int(mc.max_model_len),
            "kv_bytes_per_token": _kv_bytes_per_token(
                mc, mc.get_num_layers(vc.parallel_config), self._args
            ),
            "vocab_size": int(mc.get_vocab_size()),
        }

    @property
    def vocab_size(self) -> int:
        return self.engine_info()["vocab_size"]

    @property
    def tokenizer(self) -> Any:
        """vLLM's tokenizer for the served model (None before ``start``)."""
        return self._llm.get_tokenizer() if self._llm is not None else None


def _kv_bytes_per_token(mc: Any, num_layers: int, args: dict[str, Any]) -> int:
    """KV bytes per token of vLLM model config ``mc`` over ``num_layers`` layers, in the KV cache
    dtype the engine args ask for (MLA keeps one latent vector per token, not K and V)."""
    cache_dtype = str(args.get("kv_cache_dtype") or "auto")
    itemsize = (
        1
        if cache_dtype.startswith("fp8")
        else int(mc.dtype.itemsize if hasattr(mc.dtype, "itemsize") else 2)
    )
    per_token = offload.kv_bytes_per_token(
        num_layers, mc.get_total_num_kv_heads(), mc.get_head_size(), itemsize
    )
    return per_token // 2 if getattr(mc, "use_mla", False) else per_token


def _logprobs(positions: Any, count: int) -> list[list[TopLogprob]] | None:
    """vLLM's sample logprobs of the last ``count`` positions (one ``{token_id: Logprob}`` per
    position, the sampled token first) as ``TopLogprob`` lists in the same order."""
    if positions is None or count == 0:
        return None
    out = []
    for i in range(len(positions) - count, len(positions)):
        step = positions[i]
        out.append(
            [TopLogprob(int(t), float(lp.logprob), lp.decoded_token) for t, lp in step.items()]
        )
    return out
