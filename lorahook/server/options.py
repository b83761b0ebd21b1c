"""``lorahook serve``'s options: the command line, its checks, and the settings replicas are built from.

The same options reach the server two ways: as command-line arguments
(:func:`add_arguments`, :func:`check_arguments`) and as the ``args`` dict of
Ray Serve's application builder, ``lorahook.server.app:app_builder``
(:func:`parse_builder_args`: long option names with underscores,
``model_dir`` for the positional one).  Both end in :class:`Settings`.

Standard library only (``transformers`` is imported to read the model's
context when settings are made).
"""
import argparse
import hashlib
import os
import time
from dataclasses import dataclass
from typing import Optional

__all__ = ["DTYPES", "ADAPTER_DTYPES", "Settings", "add_arguments", "api_key", "check_arguments",
           "default_capacity_bytes", "key_warning", "parse_builder_args", "settings_from",
           "SERVER_ONLY"]

DTYPES = ("auto", "float32", "bfloat16", "float16")
#: What ``--adapter-dtype`` takes: the dtype replicas hold adapters in.
ADAPTER_DTYPES = ("float32", "bfloat16", "float16", "int8")
#: Ray Serve's multiplexing cap, adapters each replica reports (``--max-models-per-replica``).
MAX_MODELS_PER_REPLICA = 64

#: Options of the ``lorahook serve`` process itself, not of the application: under Ray
#: Serve's own tooling, HTTP and the cluster are set in Serve's config instead.
SERVER_ONLY = ("host", "port", "address")


def add_arguments(parser):
    parser.add_argument("model_dir", metavar="MODEL_DIR",
                        help="a transformers causal LM and its tokenizer (a local directory)")
    parser.add_argument("--adapters", metavar="DIR",
                        help="PEFT adapters, one directory each: <DIR>/<name> is served as "
                             "model '<name>'")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    parser.add_argument("--replicas", type=int, default=1, help="server replicas (1)")
    parser.add_argument("--capacity-bytes", type=int, default=None,
                        help="bytes of adapters each replica keeps resident; a request waits "
                             "until its adapter fits beside the running ones (default: a "
                             "quarter of this machine's memory, divided among the replicas)")
    parser.add_argument("--adapter-dtype", choices=ADAPTER_DTYPES, default="float32",
                        help="the dtype adapters are held in: bfloat16 and float16 hold twice "
                             "as many in the same capacity, int8 (a scale per row of A and per "
                             "output of B) about four times (float32)")
    parser.add_argument("--max-models-per-replica", type=int, default=MAX_MODELS_PER_REPLICA,
                        help="adapters each replica reports to Ray Serve's router, which sends "
                             "an adapter's requests to the replicas reporting it; past it, the "
                             "least recently used stops being reported (its bytes stay bounded "
                             f"by --capacity-bytes) ({MAX_MODELS_PER_REPLICA})")
    parser.add_argument("--resolver-capacity-bytes", type=int, default=None,
                        help="bytes of adapters the head node's shared loader keeps in Ray's "
                             "object store for the replicas; past it, the least recently "
                             "loaded are dropped and read again when next needed (default: "
                             "--capacity-bytes times --replicas)")
    parser.add_argument("--max-batch-size", type=int, default=16,
                        help="requests generated together in one batch (16)")
    parser.add_argument("--max-adapters", type=int, default=None,
                        help="distinct adapters in one batch (default: no limit)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="prompt + max_tokens of a request, at most the model's context "
                             "(default: the model's context)")
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20,
                        help="largest request body, bigger ones get 413 (4 MiB)")
    parser.add_argument("--max-queued-requests", type=int, default=256,
                        help="requests each replica lets wait for a batch; more get 503 (256)")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds a request may take from its arrival; then 504, or an "
                             "error event for a stream (600)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM or SIGINT, or when a replica is replaced: seconds the "
                             "requests already admitted may take to finish; new ones get 503 "
                             "meanwhile, and those still running then end with an error (30)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of each replica, which reserves that many of Ray's "
                             "CPUs (default: this machine's CPUs divided among the replicas)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="the model's dtype (auto: as saved)")
    parser.add_argument("--address", default="local",
                        help="Ray: 'local' starts one here on 127.0.0.1 without its dashboard "
                             "(default), 'auto' or an address joins a cluster")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                             "(visible in a process listing: prefer --api-key-file or "
                             "LORAHOOK_API_KEY)")
    parser.add_argument("--api-key-file", metavar="PATH", default=None,
                        help="read the key from this file (its first line)")
    parser.add_argument("--allow-runtime-adapters", action="store_true",
                        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                             "(needs --runtime-adapter-root)")
    parser.add_argument("--runtime-adapter-root", metavar="DIR", default=None,
                        help="the directory runtime adapters must be under (symlinks followed)")
    return parser


def api_key(args, environ=os.environ):
    """The key from --api-key, --api-key-file or LORAHOOK_API_KEY (in that order), or None."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        with open(args.api_key_file, encoding="utf-8") as f:
            key = f.readline().strip()
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file!r} holds no key")
        return key
    key = args.api_key if args.api_key is not None else environ.get("LORAHOOK_API_KEY")
    if key is not None and not key.strip():
        raise ValueError("the API key is empty")
    return None if key is None else key.strip()


def check_arguments(args):
    """Refuse bad settings before Ray starts; returns the API key (or ``None``)."""
    for name, low in (("replicas", 1), ("max_batch_size", 1), ("port", 1), ("threads", 1),
                      ("max_adapters", 1), ("capacity_bytes", 0), ("max_model_len", 1),
                      ("max_models_per_replica", 1), ("resolver_capacity_bytes", 0),
                      ("max_body_bytes", 1), ("max_queued_requests", 1)):
        if getattr(args, name) is not None and getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}")
    for name in ("request_timeout", "drain_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if not os.path.isdir(args.model_dir):
        raise FileNotFoundError(f"MODEL_DIR {args.model_dir!r} is not a directory")
    if args.adapters and not os.path.isdir(args.adapters):
        raise FileNotFoundError(f"--adapters {args.adapters!r} is not a directory")
    if args.allow_runtime_adapters and not args.runtime_adapter_root:
        raise ValueError("--allow-runtime-adapters needs --runtime-adapter-root DIR (the "
                         "directory runtime adapters must be under)")
    if args.runtime_adapter_root and not args.allow_runtime_adapters:
        raise ValueError("--runtime-adapter-root is for --allow-runtime-adapters")
    if args.runtime_adapter_root and not os.path.isdir(args.runtime_adapter_root):
        raise FileNotFoundError(f"--runtime-adapter-root {args.runtime_adapter_root!r} is not "
                                f"a directory")
    return api_key(args)


def parse_builder_args(args):
    """The options of Ray Serve's application-builder ``args`` dict, parsed as the command line's.

    Keys are the long option names with underscores (``max_batch_size``),
    ``model_dir`` is the positional one; values may be strings (``serve run
    ... replicas=2``) or the config file's numbers and booleans.  An unknown
    key, or one that belongs to the ``lorahook serve`` process (``host``,
    ``port``, ``address``: Serve's config sets those), is refused by name.
    """
    if not isinstance(args, dict):
        raise TypeError(f"the application's args must be a dict, got {type(args).__name__}")
    parser = add_arguments(_Parser(prog="lorahook.server.app:app_builder"))
    flags = {a.dest: a for a in parser._actions if a.dest != "help"}
    if "model_dir" not in args:
        raise ValueError("the application's args need 'model_dir' (the model's directory)")
    argv = []
    for name, value in args.items():
        if not isinstance(name, str) or name not in flags:
            known = ", ".join(sorted(set(flags) - set(SERVER_ONLY)))
            raise ValueError(f"unknown option {name!r} in the application's args; known: {known}")
        if name in SERVER_ONLY:
            raise ValueError(f"{name!r} is not an option of the application: under Ray Serve, "
                             f"set it in Serve's config (http_options, the cluster's address)")
        if name == "model_dir":
            continue
        option = flags[name].option_strings[0]
        if isinstance(flags[name], argparse._StoreTrueAction):
            if value not in (True, False, "true", "false", "True", "False", "1", "0", 1, 0):
                raise ValueError(f"{name!r} must be true or false, got {value!r}")
            if value in (True, "true", "True", "1", 1):
                argv.append(option)
        elif value is not None:
            argv += [option, str(value)]
    argv.append(str(args["model_dir"]))
    return parser.parse_args(argv)


class _Parser(argparse.ArgumentParser):
    """An argument parser that raises ``ValueError`` instead of exiting the process."""

    def error(self, message):
        raise ValueError(f"the application's args: {message}")


@dataclass(frozen=True)
class Settings:
    """What every replica is built from (pickled to each replica)."""

    model_dir: str
    adapters_dir: Optional[str] = None
    capacity_bytes: Optional[int] = None
    adapter_dtype: str = "float32"
    max_models_per_replica: int = MAX_MODELS_PER_REPLICA
    resolver_capacity_bytes: Optional[int] = None
    max_batch_size: int = 16
    max_adapters: Optional[int] = None
    batch_wait_timeout_s: float = 0.01
    dtype: str = "auto"
    api_key: Optional[str] = None
    runtime_root: Optional[str] = None  # runtime adapters allowed, from under this directory
    threads: int = 1
    replicas: int = 1
    max_model_len: Optional[int] = None
    max_body_bytes: int = 4 << 20
    max_queued_requests: int = 256
    request_timeout: float = 600.0
    drain_timeout: float = 30.0
    created: int = 0

    @property
    def base_id(self):
        return os.path.basename(self.model_dir.rstrip("/"))

    @property
    def resolver_name(self):
        """The name of the shared resolver's actor: one per adapters directory, so a
        redeployment over another directory never joins the previous one's loads."""
        # and one per dtype: a redeployment in another dtype loads anew
        digest = hashlib.sha256(f"{self.adapters_dir}\0{self.adapter_dtype}".encode()
                                ).hexdigest()[:16]
        return f"lorahook-serve-adapters-{digest}"


def _context(model_dir, max_model_len):
    """``--max-model-len`` checked against the model's context (read from its config)."""
    import transformers
    from .engine import model_context
    context = model_context(transformers.AutoConfig.from_pretrained(model_dir))
    if max_model_len is None:
        if context is None:
            raise ValueError("the model's config gives no max_position_embeddings: give "
                             "--max-model-len")
        return None
    if context is not None and max_model_len > context:
        raise ValueError(f"--max-model-len {max_model_len} is more than the model's context "
                         f"({context} tokens)")
    return max_model_len


def key_warning(settings):
    """The start-up warning for runtime adapters allowed without a key, or ``None``."""
    if settings.runtime_root is not None and settings.api_key is None:
        return ("runtime adapters are allowed without an API key: anyone who can reach the "
                f"server can load adapters from under {settings.runtime_root}")
    return None


def default_capacity_bytes(replicas):
    """``--capacity-bytes``'s default: a quarter of this machine's memory over ``replicas``."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, memory // 4 // replicas)


def settings_from(args, key):
    """The replicas' :class:`Settings` from checked options and their API key."""
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
    capacity = (args.capacity_bytes if args.capacity_bytes is not None
                else default_capacity_bytes(args.replicas))
    shared = (args.resolver_capacity_bytes if args.resolver_capacity_bytes is not None
              else capacity * args.replicas)
    return Settings(
        model_dir=os.path.abspath(args.model_dir),
        adapters_dir=os.path.abspath(args.adapters) if args.adapters else None,
        capacity_bytes=capacity, adapter_dtype=args.adapter_dtype,
        max_models_per_replica=args.max_models_per_replica, resolver_capacity_bytes=shared,
        max_batch_size=args.max_batch_size,
        max_adapters=args.max_adapters, dtype=args.dtype, api_key=key,
        runtime_root=os.path.realpath(args.runtime_adapter_root) if args.runtime_adapter_root
        else None, threads=threads, replicas=args.replicas,
        max_model_len=_context(args.model_dir, args.max_model_len),
        max_body_bytes=args.max_body_bytes, max_queued_requests=args.max_queued_requests,
        request_timeout=args.request_timeout, drain_timeout=args.drain_timeout,
        created=int(time.time()))
