"""An api worker: the aiohttp server (uvloop) that owns client connections and their requests.

Several workers share one port through SO_REUSEPORT. Each request id carries the worker's index,
so the detokenizer routes deltas back to the worker that owns the connection.

The worker holds each live request's durable state: what was submitted (with a seed it picks when
the client gave none) and the token ids streamed so far. When a backend actor restarts (a new
epoch), it replays every live request as (prompt, tokens already generated); the pipeline picks
it up like a preempted request, and the client sees a pause. When the tokenizer restarts within the
epoch (ActorSpec.keeps_epoch), only the requests that have had no answer yet are submitted again:
the dead tokenizer may have held them, and the scheduler takes a request it already has once. When
the detokenizer does, each scheduler announces its requests again with all their tokens, and the
worker keeps, of that whole text and those ids, what its client has not had yet. A worker's own
death ends its connections only: the epoch stays, the schedulers drop its requests, and its
successor numbers requests from a fresh block (actors.kinds.first_counter).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import orjson
import structlog
from aiohttp import web

from actors.base import Actor
from actors.control import ActorState
from actors.frames import Abort, Delta, Deltas, Detok, FlushCache, LoraAdapter, Ping, Submit, decode
from actors.gauges import ApiGauge, SchedulerGauge, TokenizerGauge
from actors.kinds import first_counter, make_rid
from actors.lora_registry import read_registry, update_registry
from actors.pipeline import scheduler_names
from actors.shadow import Mirror
from api.app import Overloaded, build_app
from api.connections import ConnectionGuard, ConnectionLimits, GuardedSite, connection_cap, runner_options
from api.errors import ApiError
from api.protocol import Limits, model_not_found
from runtime.config import ModelConfig
from runtime.obs import expert_load
from runtime.obs.metrics import metrics
from runtime.sampling_params import SamplingParams
from runtime.scheduler.scheduler import FINISH_REASONS
from transport.ring import PayloadTooLarge

log = structlog.get_logger()
PING_S = 1.0  # a ping goes through the pipeline this often
WARM_PARAMS = SamplingParams(max_tokens=1, temperature=0)  # a warm-up request: prefill, and one greedy token
FLUSH_TIMEOUT_S = 30.0  # a flush that has not come back by then was lost (a crash took it)
ADAPTER_TIMEOUT_S = 300.0  # an adapter's load that has not come back by then was lost (reading a large one takes a while)
STALLED_AFTER_S = 10.0  # /health says "stalled" once no ping has come back for this long (a loaded pipeline is slow, not down)


@dataclass
class LiveRequest:
    submit: Submit
    inbox: asyncio.Queue
    client: str  # its API key or address (api.app), whose share of the server it counts in
    generated: list[int] = field(default_factory=list)
    answered: bool = False  # a delta came back: the request is past the tokenizer
    text_chars: int = 0  # of text streamed so far


class ApiWorker(Actor):
    async def setup(self) -> None:
        serve = self.options["serve"]
        self.worker = self.options["worker"]
        self.served_model, self.api_keys = serve.served_model_name, serve.api_keys
        for reason in FINISH_REASONS:  # exported at 0 from the start, as Prometheus advises
            metrics().success.labels(self.served_model, reason)
        model = ModelConfig.load(Path(serve.model_dir))
        self.max_model_len, self.vocab_size, self.moe = model.max_position, model.vocab_size, model.moe is not None
        self.page_size, self.kv_cache_dtype = serve.engine.page_size, serve.engine.kv_cache_dtype
        self.deterministic, self.sampling_defaults = serve.engine.deterministic, serve.engine.override_generation_config
        self.config = serve.record()  # what /server_info reports, so a benchmark records what ran
        self.priorities = serve.engine.schedule_policy == "priority"
        self.lora, self.started_adapters = serve.engine.enable_lora, serve.engine.lora_adapters
        self.tool_call_parser, self.reasoning_parser = serve.tool_call_parser, serve.reasoning_parser
        self._tokenizer_slot = self.control.index("tokenizer")
        self._tokenizer_restarts = int(self.control.slots[self._tokenizer_slot]["restarts"])
        self.capacity = serve.engine.max_running_requests + serve.max_queued_requests
        self.request_timeout, self.body_timeout, self.write_timeout = serve.request_timeout, serve.body_timeout, serve.write_timeout
        self.max_stream_backlog, self.max_request_sequences = serve.max_stream_backlog, serve.max_request_sequences
        self.client_places = max(1, int(serve.client_share * self.capacity / serve.api_workers))  # one client's, in this worker
        self.cache_salt_by_key = serve.cache_salt_by_key
        # with a key the key guards the server; "*": the operator lets every Host in
        self.allowed_hosts = None if self.api_keys or "*" in serve.allowed_hosts else (*serve.allowed_hosts, serve.host)
        self.live: dict[int, LiveRequest] = {}
        self.by_client: Counter[str] = Counter()  # live requests of each client
        self._counter = itertools.count(first_counter(int(self.slot["restarts"])))
        self._workers = [i for i, (_, kind) in enumerate(self.control.actors) if kind == "api"]
        self.slot["gauges"][ApiGauge.LIVE] = 0  # a restarted worker holds nothing yet
        self.last_pong = 0.0
        self.schedulers = scheduler_names(serve)
        shadow = self.options.get("shadow")
        self.mirror = None if shadow is None else Mirror(shadow, serve.shadow_engine, serve.shadow_fraction, lambda: self.control.shadow)
        # rid -> the pages each replica's flush evicted, and the future that gets their sum once all are back
        self._flushes: dict[int, tuple[list[int], asyncio.Future[int]]] = {}
        self._adapter_ops: dict[int, tuple[list[LoraAdapter], asyncio.Future[list[LoraAdapter]]]] = {}
        self._replaying: asyncio.Task | None = None
        self._warming: asyncio.Task | None = None
        # prefixes this worker pinned (POST /warm_prefixes; worker 0 also --warm-prefixes), warmed again in a new epoch
        self.warmed: list[dict] = (
            [{"prompt": p} if isinstance(p, str) else {"ids": p} for p in serve.warm_prefixes] if self.worker == 0 else []
        )
        limits = ConnectionLimits(connection_cap(serve.max_connections), serve.max_client_connections, serve.header_timeout)
        self.runner = web.AppRunner(build_app(self), access_log=None, handler_cancellation=True, **runner_options(limits))
        await self.runner.setup()
        await GuardedSite(self.runner, serve.host, serve.port, ConnectionGuard(limits)).start()

    def on_epoch(self, epoch: int) -> None:
        """A backend actor restarted and dropped every request: hand them all in again (once: a
        replay still under way belongs to an epoch that is gone). /health says "recovering" until a
        ping of the new epoch comes back."""
        self.last_pong = 0.0
        self._tokenizer_restarts = int(self.control.slots[self._tokenizer_slot]["restarts"])  # this replay covers it
        loop = asyncio.get_running_loop()
        loop.create_task(self._send_ping())
        if self._replaying is not None:
            self._replaying.cancel()
        # the snapshot is taken now: a request submitted from here on is already of the new epoch
        self._replaying = loop.create_task(self._replay(list(self.live), epoch), name="replay") if self.live else None
        if self.warmed:
            if self._warming is not None:
                self._warming.cancel()
            self._warming = loop.create_task(self._warm_again(), name="warm-again")

    def on_tick(self) -> None:
        """A tokenizer restart within the epoch: submit again what it may have held, and ping (so may a ping)."""
        restarts = int(self.control.slots[self._tokenizer_slot]["restarts"])
        if restarts == self._tokenizer_restarts:
            return
        self._tokenizer_restarts = restarts
        unanswered = [rid for rid, live in self.live.items() if not live.answered]
        loop = asyncio.get_running_loop()
        loop.create_task(self._send_ping())
        if unanswered:
            loop.create_task(self._replay(unanswered, self.epoch), name="resubmit")

    async def _replay(self, rids: list[int], epoch: int) -> None:
        log.info("replaying", requests=len(rids))
        try:
            for rid in rids:
                if (live := self.live.get(rid)) is not None:  # not finished or aborted meanwhile
                    await self.send("tokenizer", replace(live.submit, generated=live.generated), rid, epoch=epoch)
        except Exception:
            log.exception("replay_failed")
            raise

    async def teardown(self) -> None:
        await self.runner.cleanup()
        if self.mirror is not None:
            await self.mirror.close()

    async def run(self) -> None:
        pinger = asyncio.create_task(self._ping(), name="ping")
        if self.warmed:
            self._warming = asyncio.create_task(self._warm_again(), name="warm-up")
        try:
            while True:
                _, frame = await self.next_frame()
                match decode(frame):
                    case Deltas(deltas=deltas):
                        for delta in deltas:
                            self._deliver(delta)
                    case Ping():
                        self.last_pong = time.monotonic()
                    case FlushCache(pages=pages):
                        if (flush := self._flushes.get(frame.rid)) is not None:
                            answers, flushed = flush
                            assert pages is not None  # a scheduler's answer always counts the pages
                            answers.append(pages)
                            if len(answers) == len(self.schedulers) and not flushed.done():
                                flushed.set_result(sum(answers))
                    case LoraAdapter() as answer:
                        if (op := self._adapter_ops.get(frame.rid)) is not None:
                            answers, done = op
                            answers.append(answer)
                            if len(answers) == len(self.schedulers) and not done.done():
                                done.set_result(answers)
        finally:
            pinger.cancel()

    def _deliver(self, delta: Delta) -> None:
        if delta.abort:  # a stop string ended it in the detokenizer: free it upstream
            asyncio.get_running_loop().create_task(self.send("tokenizer", Abort(), delta.rid))
        live = self.live.get(delta.rid)
        if live is None:
            return
        if delta.resync:  # the whole completion so far, from a new detokenizer: keep what the client has not had
            delta = replace(delta, text=delta.text[live.text_chars :], token_ids=delta.token_ids[len(live.generated) :], resync=False)
        live.generated += delta.token_ids
        live.text_chars += len(delta.text)
        live.answered = True
        live.inbox.put_nowait(delta.as_dict())
        if delta.error is not None or delta.finish is not None:
            self._forget(delta.rid)

    async def _ping(self) -> None:
        """A ping through tokenizer, scheduler, engine and detokenizer back here keeps /health honest."""
        while True:
            await self._send_ping()
            await asyncio.sleep(PING_S)

    async def _send_ping(self) -> None:
        await self.send("tokenizer", Ping(), make_rid(self.worker, 0))

    def _forget(self, rid: int) -> None:
        if (live := self.live.pop(rid, None)) is not None:
            self.by_client[live.client] -= 1
            if not self.by_client[live.client]:
                del self.by_client[live.client]
        self.slot["gauges"][ApiGauge.LIVE] = len(self.live)

    # -- the Gateway the app talks to ---------------------------------------------------------

    def check_capacity(self, count: int, client: str) -> None:
        """Refuse at once, before any work, when `count` more requests of `client` would not fit: for now
        (Overloaded, a 503 worth retrying), or ever (a 400: a retry would be refused again). Once half the
        places are taken, a client that holds some already may hold no more than its share of them."""
        most = min(self.capacity, self.max_request_sequences)
        if count > most:
            raise ApiError(
                f"the request asks for {count} completions (prompts x n); this server takes at most {most} in one request", param="n"
            )
        if self.control.draining:
            raise Overloaded("the server is shutting down")
        taken = sum(self.control.slots[i]["gauges"][ApiGauge.LIVE] for i in self._workers)
        if taken + count > self.capacity:
            raise Overloaded("the server is at capacity: every running and queued place is taken")
        held = self.by_client[client]
        if held and taken + count > self.capacity // 2 and held + count > self.client_places:
            raise Overloaded(f"this client holds {held} of the server's places, its share while the server is busy")

    async def submit(self, meta: dict, ids: list[int] | None, inbox: asyncio.Queue, client: str) -> int:
        rid = make_rid(self.worker, next(self._counter))
        params = meta["params"]
        if params.seed is None:  # picked here (a warm-up's; the app picks a client request's), so that a replay samples the same tokens
            params = replace(params, seed=random.getrandbits(63))
        submit = Submit(
            params,
            Detok(**meta["detok"]),
            meta["trace"],
            meta["messages"],
            meta["prompt"],
            ids,
            guide=meta["guide"],
            template=meta["template"],
            pin=meta.get("pin", False),
        )
        self.live[rid] = LiveRequest(submit, inbox, client)
        self.by_client[client] += 1
        self.slot["gauges"][ApiGauge.LIVE] = len(self.live)
        try:
            await self.send("tokenizer", submit, rid)
        except BaseException as exc:  # cancelled by a client that left, or too large for the ring
            self._forget(rid)
            if isinstance(exc, PayloadTooLarge):  # a prompt of megabytes: a body may outgrow the ring
                raise ApiError(f"the prompt is too large to tokenize here: {exc}", 413, param="prompt") from None
            if isinstance(exc, orjson.JSONEncodeError):  # nested deeper than a frame's header may be
                raise ApiError(f"the request cannot be sent on: {exc}") from None
            raise
        return rid

    async def abort(self, rid: int) -> None:
        if rid in self.live:
            self._forget(rid)
            await self.send("tokenizer", Abort(), rid)

    async def flush_cache(self, unpin: bool = False) -> int:
        rid = make_rid(self.worker, next(self._counter))
        flushed = asyncio.get_running_loop().create_future()
        self._flushes[rid] = ([], flushed)
        if unpin:
            self.warmed = []
        try:
            await self.send("tokenizer", FlushCache(unpin=unpin), rid)
            return await asyncio.wait_for(flushed, FLUSH_TIMEOUT_S)
        except TimeoutError:
            raise ApiError("the prefix cache flush was lost in a restart of the pipeline; flush again", 503, kind="server_error") from None
        finally:
            self._flushes.pop(rid, None)

    async def lora_adapter(self, name: str, path: str | None) -> dict[str, str]:
        """Load the adapter at `path` as `name` on every engine (None: unload it); the adapters served after."""
        if not self.lora:
            raise ApiError("LoRA is off: start the server with --enable-lora (or --lora-paths) to load adapters", param="lora_name")
        served = self.adapters()
        if path is None and name not in served:
            raise model_not_found(f"no LoRA adapter named '{name}' is loaded", "lora_name")
        if name == self.served_model:
            raise ApiError(f"'{name}' names the base model", param="lora_name")
        rid = make_rid(self.worker, next(self._counter))
        done = asyncio.get_running_loop().create_future()
        self._adapter_ops[rid] = ([], done)
        try:
            await self.send("tokenizer", LoraAdapter(name, path), rid)
            answers = await asyncio.wait_for(done, ADAPTER_TIMEOUT_S)
        except TimeoutError:
            raise ApiError("the adapter's load or unload was lost in a pipeline restart; ask again", 503, kind="server_error") from None
        finally:
            self._adapter_ops.pop(rid, None)
        if errors := [answer.error for answer in answers if answer.error is not None]:
            raise ApiError(errors[0], param="lora_path" if path is not None else "lora_name")
        return update_registry(self.ctx.server, self.started_adapters, name, path)

    def adapters(self) -> dict[str, str]:
        """name -> path of each LoRA adapter served now."""
        return read_registry(self.ctx.server, self.started_adapters) if self.lora else {}

    async def warm(self, prefixes: list[dict]) -> list[dict]:
        """Each prefix runs as a one-token greedy request marked to pin its prompt in the prefix cache;
        this worker warms them again after a restart of the pipeline (which empties the cache). A refusal,
        or a client that leaves, aborts the prefixes not yet warmed."""
        inbox: asyncio.Queue = asyncio.Queue()
        rids: list[int] = []
        usages: dict[int, dict] = {}
        try:
            await self._warm_each(prefixes, inbox, rids, usages)
        finally:
            for rid in rids:
                if rid not in usages:
                    await self.abort(rid)
        self.warmed += [p for p in prefixes if p not in self.warmed]
        log.info("prefixes_warmed", prefixes=len(prefixes), pinned=len(self.warmed))
        return [
            {"prompt_tokens": u["prompt_tokens"], "pinned_tokens": u["prompt_tokens"] // self.page_size * self.page_size}
            for u in (usages[rid] for rid in rids)
        ]

    async def _warm_each(self, prefixes: list[dict], inbox: asyncio.Queue, rids: list[int], usages: dict[int, dict]) -> None:
        """Submits the warm-up requests (their rids into `rids`) and waits for each one's usage."""
        for i, prefix in enumerate(prefixes):
            meta = {
                "params": WARM_PARAMS,
                "detok": {"stop": [], "skip_special_tokens": True, "top_logprobs": 0},
                "trace": f"warm-{self.worker}-{i}",
                "messages": None,
                "prompt": prefix.get("prompt"),
                "guide": None,
                "template": None,
                "pin": True,
            }
            rids.append(await self.submit(meta, prefix.get("ids"), inbox, "warm-up"))
        while len(usages) < len(rids):
            delta = await inbox.get()
            if "error" in delta:
                raise ApiError(delta["error"]["message"], delta["error"]["status"], param="prefixes")
            if delta["finish"] is not None:
                usages[delta["rid"]] = delta["usage"]

    async def _warm_again(self) -> None:
        """The start-up prefixes once the pipeline answers; after a new epoch, what this worker had warmed."""
        while self.health() != "ok":
            await asyncio.sleep(0.05)
        try:
            await self.warm(list(self.warmed))
        except ApiError as exc:
            log.error("prefix_warm_up_failed", error=exc.message)

    def limits(self) -> Limits:
        token_bytes = int(self.control.slots[self._tokenizer_slot]["gauges"][TokenizerGauge.TOKEN_BYTES])  # 0 until it has loaded
        return Limits(
            self.max_model_len,
            self.vocab_size,
            token_bytes,
            self.priorities,
            self.tool_call_parser,
            self.reasoning_parser,
            tuple(self.adapters().items()),
            self.sampling_defaults,
        )

    def health(self) -> str:
        """ "ok"; "draining" on the way down; "recovering" from an actor's start or restart until a ping of the
        new epoch has come back through the pipeline (then "ok", however loaded the replay keeps it);
        "stalled" when no ping has come back for STALLED_AFTER_S."""
        if self.control.draining:
            return "draining"
        if not (self.control.slots["state"] == ActorState.READY).all() or not self.last_pong:
            return "recovering"
        return "stalled" if time.monotonic() - self.last_pong > STALLED_AFTER_S else "ok"

    def server_info(self) -> dict:
        """The KV cache's dtype and tokens, whether inference is deterministic; the schedulers' gauges: each
        replica's, and their sums under "scheduler"; for a mixture-of-experts model, each replica's latest
        interval of routing counts under "moe"; under "config", every setting the server runs with; under "shadow", the
        shadow server's flags, state and own settings (actors.shadow)."""
        replicas = []
        for name in self.schedulers:
            gauges = self.control.slots[self.control.index(name)]["gauges"]
            replicas.append({g.name.lower(): int(gauges[g]) for g in SchedulerGauge})
        engine = self.config["engine"]
        info = {
            "model": self.served_model,
            # SGLang's names, which its router reads (`ringllm router`)
            "served_model_name": self.served_model,
            "model_path": self.config["model_dir"],
            "tp_size": engine["tensor_parallel_size"],
            "dp_size": self.config["data_parallel_size"],
            "max_model_len": self.max_model_len,
            "epoch": self.epoch,
            "kv_cache_dtype": self.kv_cache_dtype,
            "deterministic": self.deterministic,  # --enable-deterministic-inference
            "kv_tokens": sum(replica["total_pages"] for replica in replicas) * self.page_size,  # 0 until the engines report
            "scheduler": {key: sum(replica[key] for replica in replicas) for key in replicas[0]},
            "replicas": replicas,
            "config": self.config,
        }
        if self.moe:
            info["moe"] = expert_load.read(len(self.schedulers))
        if self.mirror is not None:
            info["shadow"] = self.mirror.report()
        return info

    def answered(self, rid: str, body: dict, choices: list[dict]) -> None:
        if self.mirror is not None:
            self.mirror.offer(rid, body, choices)
