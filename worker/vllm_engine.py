"""The engine port on vLLM's `AsyncLLM`: the only module of llmq that imports vllm.

One AsyncLLM per worker process, created on the worker's event-loop thread and shared by
every in-flight job, so vLLM's scheduler batches them continuously. Outputs are requested
as deltas, so each update costs only the new tokens.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import psutil

from app.logs import vllm_logging_environment
from app.settings import Settings
from worker.engine import (
    ChoiceDelta,
    EngineDead,
    EngineUpdate,
    GenerationSpec,
    PromptLogprob,
    PromptTooLong,
    RequestRejected,
    TokenLogprob,
)

log = logging.getLogger("llmq.engine")

# Tokens per update of a request a client began to stream after it started (`hasten`):
# every other step's, where the live stream's chunks are 8 tokens or 40 ms apart anyway
# (worker/streaming.py). Not 1: at 1, vLLM 0.32 gives a request only the step's own tokens,
# and those it held back since the request's last update would be lost.
LIVE_INTERVAL = 2


class VllmEngine:
    name = "vllm"
    # DELTA outputs: vLLM's per-request collector merges the steps its consumer has not
    # taken yet into one output (text, token ids and logprobs appended).
    merges_updates = True

    def __init__(self, settings: Settings) -> None:
        # vLLM configures logging in each of its processes from its own settings, which the
        # engine core reads from the environment: point them at llmq's configuration so
        # every vLLM line, the engine core's included, is in llmq's format.
        os.environ.update(vllm_logging_environment(settings))
        import vllm

        self.version = str(vllm.__version__)
        self._settings = settings
        self._llm: Any = None
        self._priority_scheduling = True
        self._tool_parser: Any = None
        self._byte_decoder: dict[str, int] | None = None
        # Requests hastened before vLLM had them (see hasten): lowered at their first update.
        self._hasten_later: set[str] = set()

    async def start(self) -> None:
        from worker.vllm_plugin import arm_children

        # The engine's processes die with this one, even under `kill -9` (they would
        # otherwise keep the KV cache and a core). The kernel signals on the exit of the
        # parent *thread*, so the thread starting them must live as long as this process:
        # this runs on the worker's loop thread, which runs until the worker stops.
        arm_children()
        from vllm import envs
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        s = self._settings
        on_cpu = bool(current_platform.is_cpu())
        if on_cpu:
            # Read by the engine processes, which inherit this environment.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{s.kv_cache_space_gib:g}")
        # On CPU, bfloat16 kernels cost small models their accuracy (SmolLM2-135M answers
        # "What is the capital of France?" with nonsense in bf16, with Paris in fp32).
        dtype = "float32" if on_cpu and s.dtype == "auto" else s.dtype
        args = AsyncEngineArgs(
            model=s.model or "",
            served_model_name=[s.model_name],
            dtype=dtype,
            max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs,
            seed=s.engine_seed,
            gpu_memory_utilization=s.gpu_memory_utilization,
            num_gpu_blocks_override=s.kv_cache_blocks,
            enforce_eager=on_cpu if s.enforce_eager is None else s.enforce_eager,
            scheduling_policy="priority" if self._priority_scheduling else "fcfs",
            # Engine-wide: the per-request whitespace options are ignored by vLLM 0.32, and
            # without this a model can pad JSON with whitespace until `length`.
            structured_outputs_config=StructuredOutputsConfig(
                backend=s.structured_output_backend, disable_any_whitespace=True
            ),
            # Stats on, with vLLM's Prometheus logger alone (its `vllm:` metrics, in the default
            # registry the worker's /metrics port serves: worker/metrics.py); its logging
            # logger, which would print them every few seconds, is left out.
            disable_log_stats=True,
            enable_prefix_caching=True,
        )
        self._llm = AsyncLLM.from_engine_args(
            args, usage_context=UsageContext.ENGINE_CONTEXT, stat_loggers=[PrometheusStatLogger]
        )
        # vLLM reads its settings from the environment at each use, and its stats read one
        # (`VLLM_COMPUTE_NANS_IN_LOGITS`) for every request at every step: about a tenth of
        # this process's output-handling CPU went to `os.getenv`. Its engine core caches them once
        # started, as here (llmq sets the variables it gives vLLM before an engine starts).
        envs.enable_envs_cache()
        if on_cpu and s.pin_engine_core:
            _pin_engine_core()

    async def generate(self, spec: GenerationSpec) -> AsyncIterator[EngineUpdate]:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        from vllm.v1.engine.exceptions import EngineDeadError

        sampling = dict(spec.sampling)
        structured = sampling.pop("structured_outputs", None)
        prompt = TokensPrompt(prompt_token_ids=spec.prompt_token_ids)
        top = sampling.get("logprobs")
        try:
            params = SamplingParams(
                **sampling,
                structured_outputs=StructuredOutputsParams(**structured) if structured else None,
                output_kind=RequestOutputKind.DELTA,
            )
            # Once per token of every running job: what does not change is looked up once.
            prompt_top = params.prompt_logprobs
            prompt_len = len(spec.prompt_token_ids)
            token_bytes = self._token_bytes
            first = True
            async for out in self._llm.generate(
                prompt, params, spec.request_id, priority=spec.priority if self._priority_scheduling else 0
            ):
                if first:
                    first = False
                    if spec.request_id in self._hasten_later:  # forgotten as this ends
                        self._lower_interval(spec.request_id)
                yield EngineUpdate(
                    deltas=[_delta(o, top, token_bytes) for o in out.outputs],
                    prompt_tokens=len(out.prompt_token_ids) if out.prompt_token_ids else prompt_len,
                    cached_tokens=int(out.num_cached_tokens or 0),
                    finished=bool(out.finished),
                    prompt_logprobs=None
                    if prompt_top is None
                    else self._prompt_logprobs(out, spec.prompt_token_ids, prompt_top),
                )
        except EngineDeadError as exc:
            raise EngineDead(str(exc)) from exc
        except VLLMValidationError as exc:
            if getattr(exc, "parameter", None) == "input_tokens" or "context length" in str(exc):
                raise PromptTooLong(str(exc)) from exc
            # The request's own fault (out-of-vocabulary token ids, ...): a 400, not an engine error.
            raise RequestRejected(str(exc), getattr(exc, "parameter", None)) from exc
        finally:
            self._hasten_later.discard(spec.request_id)

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    def hasten(self, request_id: str) -> None:
        """vLLM fixes a request's `stream_interval` as it arrives; here it is lowered, in
        the state vLLM's output processor keeps for the request (for each of its children
        with n > 1), which runs on this loop. A request vLLM does not have yet is lowered at
        its first update. That state is not a public API of vLLM: on a version without it,
        the request keeps its interval and its stream comes in coarser chunks."""
        if not self._lower_interval(request_id) and len(self._hasten_later) < 100_000:
            self._hasten_later.add(request_id)

    def _lower_interval(self, request_id: str) -> bool:
        """False when vLLM has no such request (yet)."""
        processor = getattr(self._llm, "output_processor", None)
        internal = getattr(processor, "external_req_ids", {}).get(request_id)
        if not internal:
            return False
        states = getattr(processor, "request_states", {})
        for internal_id in internal:
            state = states.get(internal_id)
            if state is not None and getattr(state, "stream_interval", 1) > LIVE_INTERVAL:
                state.stream_interval = LIVE_INTERVAL
        return True

    async def close(self) -> None:
        """Shut the engine down and make sure none of its processes outlive it (a vLLM
        worker process was seen lingering after its engine core exited)."""
        if self._llm is None:
            return
        children = [p for p in psutil.Process().children(recursive=True) if not _is_resource_tracker(p)]
        self._llm.shutdown()
        self._llm = None
        for sig_name, grace in (("terminate", 10.0), ("kill", 5.0)):
            alive = _wait_gone(children, grace)
            if not alive:
                return
            for proc in alive:
                log.warning(
                    "engine process still running after shutdown", extra={"pid": proc.pid, "action": sig_name}
                )
                with contextlib.suppress(psutil.Error):
                    getattr(proc, sig_name)()
        _wait_gone(children, 5.0)

    def process_ids(self) -> list[int]:
        """The engine core runs in child processes of this one."""
        try:
            return [p.pid for p in psutil.Process().children(recursive=True)]
        except psutil.Error:
            return []

    def max_model_len(self) -> int:
        return int(self._llm.model_config.max_model_len)

    def tokenizer(self) -> Any:
        return self._llm.get_tokenizer()

    def _prompt_logprobs(self, out: Any, prompt_ids: list[int], top: int) -> list[PromptLogprob] | None:
        """The prompt's tokens with their logprobs (`echo` with `logprobs`; called only for a
        request that asked for them), from the first output that carries them: vLLM gives
        None for the first position."""
        positions = getattr(out, "prompt_logprobs", None)
        if not positions:
            return None
        tokenizer = self._llm.get_tokenizer()
        entries = []
        for token_id, position in zip(prompt_ids, positions, strict=False):
            chosen = position.get(token_id) if position else None
            text = (chosen.decoded_token if chosen else None) or tokenizer.decode([token_id])
            ranked = sorted(
                (position or {}).items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 0
            )
            alternatives = [(t, lp) for t, lp in ranked if lp.rank is not None and lp.rank <= top][:top]
            entries.append(
                PromptLogprob(
                    token=str(text),
                    logprob=max(float(chosen.logprob), -9999.0) if chosen else None,
                    top=[(lp.decoded_token or "", max(float(lp.logprob), -9999.0)) for _, lp in alternatives],
                )
            )
        return entries

    def _token_bytes(self, token_id: int, decoded: str) -> list[int]:
        """A token's own bytes: byte-level BPE vocabularies spell bytes as characters
        (GPT-2's map), so a token that is half of a UTF-8 character still has its bytes."""
        if self._byte_decoder is None:
            self._byte_decoder = {ch: b for b, ch in _bytes_to_unicode().items()}
        piece = self._llm.get_tokenizer().convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(ch in self._byte_decoder for ch in piece):
            return [self._byte_decoder[ch] for ch in piece]
        return list(decoded.encode("utf-8"))

    def extract_tool_calls(
        self, text: str, request: dict[str, Any]
    ) -> tuple[str | None, list[dict[str, Any]]] | None:
        """Read tool calls out of free text with the configured vLLM tool parser
        (`tool_choice: auto`); None when it finds none."""
        if not self._settings.tool_call_parser:
            return None
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        if self._tool_parser is None:
            parser_cls = ToolParserManager.get_tool_parser(self._settings.tool_call_parser)
            self._tool_parser = parser_cls(self._llm.get_tokenizer())
        vllm_request = ChatCompletionRequest.model_validate(
            {k: v for k, v in request.items() if k in ("model", "messages", "tools", "tool_choice")}
        )
        info = self._tool_parser.extract_tool_calls(text, vllm_request)
        if not info.tools_called:
            return None
        calls = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in info.tool_calls
        ]
        return info.content, calls


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: printable bytes stand for themselves, the others
    are shifted past 255."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    shift = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + shift)
            shift += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _pin_engine_core() -> None:
    """Put the engine core process on the model worker's cores.

    vLLM's CPU backend binds the model to some cores and leaves the rest to everything else;
    its engine core process, though, waits for model outputs by spinning (sched_yield) and
    takes a whole core from the API, Redis and this worker's threads. On the model's cores
    it yields to the model instead: measured here, engine throughput -6 %, SSE delivery lag
    from ~200 ms to a few ms on a 2-core machine.
    """
    procs = psutil.Process().children(recursive=True)
    named = {p: " ".join(p.cmdline()) for p in procs}
    model_cores = next((p.cpu_affinity() for p, name in named.items() if "VLLM::Worker" in name), None)
    if not model_cores:
        return
    for proc, name in named.items():
        if "EngineCore" in name:
            with contextlib.suppress(psutil.Error):
                proc.cpu_affinity(model_cores)
                log.info("engine core pinned to the model's cores", extra={"cores": model_cores})


def _is_resource_tracker(proc: psutil.Process) -> bool:
    """multiprocessing's resource tracker exits by itself once this process does."""
    try:
        return "resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return True


def _wait_gone(procs: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    """Poll (psutil's waits were seen to hang on grandchildren) until `procs` exit."""
    deadline = time.monotonic() + seconds
    alive = procs
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if _running(p)]
    return alive


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _delta(output: Any, top: int | None, token_bytes: Any) -> ChoiceDelta:
    return ChoiceDelta(
        index=int(output.index),
        text=output.text or "",
        token_ids=list(output.token_ids or ()),
        logprobs=None if output.logprobs is None else _logprobs(output, top, token_bytes),
        finish_reason=output.finish_reason,
        stop_reason=output.stop_reason,
    )


def _logprobs(output: Any, top: int | None, token_bytes: Any) -> list[TokenLogprob]:
    """vLLM's per-position {token id: Logprob} (an output that has them) → OpenAI's
    entries: the sampled token, its bytes, and exactly `top` alternatives by rank."""
    items = []
    for token_id, position in zip(output.token_ids, output.logprobs, strict=False):
        chosen = position.get(token_id)
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 0)
        alternatives = [(tid, lp) for tid, lp in ranked if lp.rank is not None and lp.rank <= (top or 0)][
            : top or 0
        ]
        items.append(
            TokenLogprob(
                token=(chosen.decoded_token if chosen else "") or "",
                logprob=max(float(chosen.logprob), -9999.0) if chosen else -9999.0,
                token_bytes=token_bytes(token_id, chosen.decoded_token if chosen else ""),
                top=[
                    (
                        lp.decoded_token or "",
                        max(float(lp.logprob), -9999.0),
                        token_bytes(tid, lp.decoded_token or ""),
                    )
                    for tid, lp in alternatives
                ],
            )
        )
    return items
