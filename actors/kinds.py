"""Frame kinds on the pipeline's rings (0 is the ring's own filler)."""

from enum import IntEnum


class Kind(IntEnum):
    SUBMIT = 1  # api worker → tokenizer: a request to tokenize
    ABORT = 2  # api worker → tokenizer → scheduler: drop a request
    REQUEST = 3  # tokenizer → scheduler: a tokenized request
    ERROR = 4  # tokenizer or scheduler → detokenizer → api worker: a request refused
    STEP = 5  # scheduler → engine: a step plan
    SAMPLED = 6  # engine → scheduler: the tokens a step sampled
    TOKENS = 7  # scheduler → detokenizer: new tokens and finishes, one frame per step
    DELTAS = 8  # detokenizer → api worker: text deltas, one frame per step
    PING = 9  # api worker → tokenizer → scheduler → engine → scheduler → detokenizer → api worker
    FLUSH_CACHE = 10  # api worker → tokenizer → scheduler (evicts the prefix cache) → detokenizer → api worker
    ADOPT = 11  # scheduler → engine at an epoch's start, and back: the KV the engine kept of the epoch before
    COMPILE = 12  # scheduler → engine: compile a waiting request's grammar; engine → scheduler: compiled, or why not
    LORA_ADAPTER = 13  # api worker → tokenizer → scheduler → engines (load or unload) → scheduler → detokenizer → api worker


def worker_of(rid: int) -> int:
    """A request id carries the index of the api worker that owns it in its top 16 bits."""
    return rid >> 48


def make_rid(worker: int, counter: int) -> int:
    return (worker << 48) | counter


def first_counter(restarts: int) -> int:
    """Where a worker's request counter starts after `restarts` restarts: each start numbers its requests
    from a fresh block of 2**32, so no id repeats within an epoch (a worker's restart keeps it), and an
    id below it is a dead start's."""
    return (restarts << 32) + 1


def counter_of(rid: int) -> int:
    return rid & ((1 << 48) - 1)
