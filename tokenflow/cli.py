"""The `tokenflow` command: generate, chat, serve, plugins, pull, list, rm, and the benchmarks (bench, bench-*).

`tokenflow --help` imports no torch and no benchmark module: a command's heavy modules load when it runs,
and a benchmark's flags are read from its module only when that benchmark is the command.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

import anyio

from tokenflow.errors import InvalidRequest, Overloaded, TokenflowError
from tokenflow.extras import check_installed

__all__ = ("main",)

# (name, type, help): the generation flags of `generate` and `chat`; a flag left out keeps SamplingParams' default
_SAMPLING_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("max_tokens", int, "tokens to generate at most (default: the engine's default_max_tokens, 128, fewer when the "
                        "context has less room)"),
    ("temperature", float, "sampling temperature; 0 is greedy (default: 1.0)"),
    ("top_p", float, "nucleus sampling: keep the fewest tokens holding this much probability (default: 1.0, off)"),
    ("top_k", int, "keep only the k most likely tokens (default: 0, off)"),
    ("min_p", float, "drop tokens less likely than this times the most likely one (default: 0.0, off)"),
    ("repetition_penalty", float, "divide the logits of tokens already seen by this (default: 1.0, off)"),
    ("presence_penalty", float, "subtract this from the logits of tokens already generated (default: 0.0)"),
    ("frequency_penalty", float, "subtract this times each token's count so far (default: 0.0)"),
    ("seed", int, "seed of this request's sampling, for repeatable samples (default: none, random)"),
    ("logprobs", int, "also return this many top alternatives per token (with --json; default: none)"),
    ("timeout", float, "give up after this many seconds (default: none, or the engine's `timeout` setting)"),
)


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default after its help unless the help already says it (flags whose default is
    decided later, e.g. by the engine, say so in their help)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or not action.option_strings or any(
            action.default is unset for unset in (None, False, argparse.SUPPRESS)
        ):
            return text
        shown = ",".join(map(str, action.default)) if isinstance(action.default, list) else "%(default)s"
        return f"{text} (default: {shown or 'none'})"


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", help="alias, HF folder, .gguf file or hub id (default: smollm2-135m, embedded)")
    p.add_argument("--config", help="TOML file of engine settings (default: $TOKENFLOW_CONFIG; none)")
    p.add_argument("--backend", help="paged (tokenflow's KV cache, continuous batching) or hf (transformers "
                                     "generate) (default: paged)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (default: auto: bf16 on CUDA and on CPUs with AVX512-BF16 or AMX, "
                        "else float32)")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N (default: auto, CUDA when there is a GPU)")
    p.add_argument("--max-model-len", type=int, metavar="TOKENS",
                   help="context length, prompt + output (default: the model's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other engine setting, e.g. --set max_num_seqs=8; repeatable (default: none; "
                        "every setting: docs/reference/settings.md)")


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    for name, kind, help_text in _SAMPLING_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=kind, dest=name, help=help_text)
    p.add_argument("--stop", action="append", help="stop when this string is generated; repeatable (default: none)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token, up to --max-tokens")


def _engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for name in ("model", "backend", "dtype", "device", "max_model_len"):
        if getattr(args, name, None) is not None:
            settings[name] = getattr(args, name)
    for item in args.set:
        key, value = _parse_set(item)
        settings[key] = value
    return settings


def _parse_set(item: str) -> tuple[str, Any]:
    """`--set KEY=VALUE`: VALUE is text, or JSON when it starts with `[` or `{`; errors name the flag."""
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UsageError(f"--set expects KEY=VALUE, got {item!r}")
    if not value:
        raise UsageError(f"--set {key}= has no value (write --set {key}=VALUE)")
    if value[0] in "[{":
        try:
            return key, json.loads(value)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--set {key}: the value is not valid JSON ({exc.msg} at {exc.pos})") from None
    return key, value


class UsageError(Exception):
    """A command line that cannot run: printed as one line, exit status 2."""


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {name: getattr(args, name) for name, _, _ in _SAMPLING_FLAGS if getattr(args, name) is not None}
    if args.stop:
        kwargs["stop"] = args.stop
    if args.ignore_eos:
        kwargs["ignore_eos"] = True
    return kwargs


def _preflight(args: argparse.Namespace) -> dict[str, Any]:
    """Check every setting and the model spec before anything slow (torch's import, the model's load):
    a typo fails in well under a second, with a did-you-mean. Returns the engine settings."""
    from tokenflow.config import EngineConfig
    from tokenflow.hub.resolve import check_model

    settings = _engine_settings(args)
    config = EngineConfig.load(config_file=args.config, **settings)  # ConfigError naming the setting
    check_model(config.model)
    if hasattr(args, "temperature"):  # generate / chat: the sampling flags too
        from tokenflow.params import SamplingParams

        SamplingParams.from_kwargs(**_sampling(args))
    return settings


def _make_engine(args: argparse.Namespace, settings: dict[str, Any]) -> Any:
    from tokenflow.engine import Engine

    return Engine(config_file=args.config, **settings)


async def _generate(args: argparse.Namespace) -> None:
    kwargs = _sampling(args)
    settings = _preflight(args)
    started = time.perf_counter()
    async with _make_engine(args, settings) as engine:
        loaded = time.perf_counter()
        use_chat = not args.raw and getattr(engine.loaded.tokenizer, "chat_template", None)
        messages = [{"role": "user", "content": args.prompt}]
        if args.stream:
            stream = engine.stream_chat(messages, **kwargs) if use_chat else engine.stream(args.prompt, **kwargs)
            async for chunk in stream:
                print(chunk.text, end="", flush=True)
            print()
        else:
            done = await (engine.chat(messages, **kwargs) if use_chat else engine.generate(args.prompt, **kwargs))
            if args.json:
                import msgspec

                print(msgspec.json.encode(done).decode())
            else:
                print(done.text)
        if args.verbose:
            ended = time.perf_counter()
            print(f"[load {loaded - started:.2f}s, generate {ended - loaded:.2f}s]", file=sys.stderr)


async def _chat(args: argparse.Namespace) -> None:
    kwargs = _sampling(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    settings = _preflight(args)
    async with _make_engine(args, settings) as engine:
        tokenizer, context = engine.loaded.tokenizer, engine.loaded.max_model_len
        reply_tokens = kwargs.get("max_tokens") or min(engine.config.default_max_tokens, context // 4)
        print("tokenflow chat — empty line or Ctrl-D to quit", file=sys.stderr)
        while True:
            try:
                line = await anyio.to_thread.run_sync(input, "you> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append({"role": "user", "content": line})
            history, dropped = await anyio.to_thread.run_sync(
                fit_history, tokenizer, history, context - reply_tokens
            )
            if dropped:
                print(f"[dropped the {dropped} oldest messages to fit the {context}-token context]", file=sys.stderr)
            if not history or history[-1]["role"] != "user":
                print(f"[that message does not fit the {context}-token context with room for a reply]",
                      file=sys.stderr)
                continue
            reply = []
            print("bot> ", end="", flush=True)
            try:
                async for chunk in engine.stream_chat(history, **kwargs):
                    print(chunk.text, end="", flush=True)
                    reply.append(chunk.text)
            except (InvalidRequest, Overloaded) as exc:
                print(f"\n[{type(exc).__name__}: {exc}]", file=sys.stderr)
                history.pop()
                continue
            print()
            history.append({"role": "assistant", "content": "".join(reply)})


def fit_history(
    tokenizer: Any, history: Sequence[dict[str, str]], budget: int
) -> tuple[list[dict[str, str]], int]:
    """Drop the oldest turns (never the system prompt) until the rendered chat has at most `budget`
    tokens; returns the kept messages and how many were dropped. The last message, the one to answer,
    goes too when it cannot fit alone, so the caller can say so instead of failing the request."""
    system = [m for m in history[:1] if m["role"] == "system"]
    turns = list(history[len(system):])
    dropped = 0

    def size(messages: list[dict[str, str]]) -> int:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    while turns and size(system + turns) > budget:
        turns.pop(0)
        dropped += 1
        while turns and turns[0]["role"] != "user":  # a conversation restarts at a user turn
            turns.pop(0)
            dropped += 1
    return system + turns, dropped


def _serve(args: argparse.Namespace) -> None:
    """Check the flags and settings, listen on the port, and only then load the model (minutes on a busy
    host): a mistake or a busy port fails at once."""
    settings = _preflight(args)
    if args.max_request_bytes <= 0:
        raise UsageError(f"--max-request-bytes must be positive, got {args.max_request_bytes}")
    check_installed("server", "tokenflow serve", "uvicorn", "starlette", "prometheus_client")
    import uvicorn

    sock = _listen(args.host, args.port)
    from tokenflow.serve.openai_app import create_app

    http = dict(api_key=args.api_key, max_request_bytes=args.max_request_bytes, cors_origins=args.cors_origin or (),
                report_cached_tokens=args.report_cached_tokens, trusted_client_fields=args.trust_client_field or ())
    app = create_app(config_file=args.config, **http, **settings)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    server.run(sockets=[sock])


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on `host:port` (IPv4 or IPv6), or a UsageError saying why not."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        hint = " (is another server running there? pick another --port)" if exc.errno == errno.EADDRINUSE else ""
        raise UsageError(f"cannot listen on {host}:{port}: {reason}{hint}") from None


def _plugins(args: argparse.Namespace) -> None:
    from tokenflow import registry

    rows = []
    for info in registry.list_plugins():
        kind = "?"
        status = "ok" if info.allowed else "blocked by TOKENFLOW_PLUGINS"
        try:
            obj = registry.find(info.group, info.name).load()
            kind = _kind_of_factory(obj, info.group)
        except Exception as exc:
            status = f"error: {exc!r}"[:60]
        group = {registry.STAGES: "stage", registry.SCHEDULERS: "scheduler", registry.KV_POOLS: "kv pool",
                 registry.TIERS: "kv tier", registry.BACKENDS: "backend", registry.POLICIES: "policy"}[info.group]
        rows.append((group, info.name, kind, info.origin, info.value, status))
    header = ("group", "name", "kind", "origin", "object", "status")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())


def _kind_of_factory(factory: Any, group: str) -> str:
    """Build the plugin with default settings to learn its kind (cheap: stages load nothing at build)."""
    from tokenflow import registry
    from tokenflow.config import EngineConfig

    config = EngineConfig()
    try:
        try:
            obj = factory(config)
        except TypeError:  # a memory stage: its factory also takes the pool's size
            obj = factory(config, num_blocks=1, block_size=1)
        return registry.kind_of(obj) or "unknown"
    except Exception:
        return "backend" if group == registry.BACKENDS else "unknown"


def _pull(args: argparse.Namespace) -> None:
    from tokenflow.hub import resolve_model

    resolved = resolve_model(args.model, progress=True)
    print(f"{resolved.name}: {resolved.path}")


def _list(args: argparse.Namespace) -> None:
    from tokenflow.hub.cache import list_models, models_root

    root = models_root()
    models = list_models(root)
    if not models:
        print(f"no converted models in {root}")
        return
    rows = [(m.name, f"{m.size_bytes / 2**20:,.0f} MiB", m.created, m.source) for m in models]
    header = ("name", "size", "created", "source")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    print(f"({len(models)} in {root})")


def _rm(args: argparse.Namespace) -> None:
    from tokenflow.hub.cache import models_root, remove_model

    root = models_root()
    for name in args.names:
        freed = remove_model(root, name)
        print(f"removed {name} ({freed / 2**20:,.0f} MiB)")


# command -> (module with `add_arguments(parser)`, its run function, help)
_BENCHES = {
    "bench": ("tokenflow.benchmarks.throughput", "run_bench", "throughput / latency benchmark against transformers"),
    "bench-tokenizer": ("tokenflow.benchmarks.tokenizer", "run_bench_tokenizer",
                        "the tokenizer stage against encoding on the event loop"),
    "bench-prefix": ("tokenflow.benchmarks.prefix", "run_bench_prefix",
                     "prefix cache: eviction hit rates and time to first token"),
    "bench-step": ("tokenflow.benchmarks.step", "run_bench_step",
                   "decode step time with and without compile; scheduler time"),
    "bench-attention": ("tokenflow.benchmarks.attention", "run_bench_attention",
                        "attention policies: perplexity, step time, KV memory"),
    "bench-quality": ("tokenflow.benchmarks.quality", "run_bench_quality",
                      "quality of bf16 and int8 against fp32: perplexity, greedy agreement"),
    "bench-dashboard": ("tokenflow.benchmarks.dashboard", "run_bench_dashboard",
                        "the cost of scraping the dashboard once a second under load"),
    "bench-plot": ("tokenflow.benchmarks.plots", "run_bench_plot",
                   "draw a saved benchmark JSON (bench, bench-prefix, bench-attention) into a PNG"),
}


LOG_LEVELS = ("debug", "info", "warning", "error")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; only the benchmark named by `command` (if any) gets its module's flags."""
    parser = argparse.ArgumentParser(prog="tokenflow", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"tokenflow {_version()}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                        help="log lines on stderr from this level up")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text, parents=[common],
                              formatter_class=HelpFormatter)

    gen = add("generate", "generate text for one prompt")
    gen.add_argument("prompt", help="the prompt (sent through the model's chat template unless --raw)")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--json", action="store_true", help="print the whole Completion as JSON")
    gen.add_argument("--verbose", "-v", action="store_true", help="print load and generation times")
    _engine_flags(gen)
    _sampling_flags(gen)

    chat = add("chat", "an interactive chat that keeps the conversation (oldest turns dropped to fit)")
    chat.add_argument("--system", help="a system prompt (default: none)")
    _engine_flags(chat)
    _sampling_flags(chat)

    add("plugins", "list the stages and backends the registry finds")

    serve = add("serve", "an OpenAI-compatible HTTP server (uvicorn) around one engine")
    _engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    serve.add_argument("--api-key", help="require `Authorization: Bearer KEY` (default: $TOKENFLOW_API_KEY; none)")
    serve.add_argument("--max-request-bytes", type=int, default=4 * 2**20, metavar="BYTES",
                       help="request bodies larger than this get 413")
    serve.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                       help="a browser origin allowed to call the API (repeatable; none by default)")
    serve.add_argument("--report-cached-tokens", action="store_true",
                       help="report usage.prompt_tokens_details.cached_tokens (off by default: it tells callers "
                            "what others sent)")
    serve.add_argument("--trust-client-field", action="append", choices=["priority", "cache_salt"],
                       help="let clients set this field themselves; repeatable (default: none, the server sets "
                            "them)")

    pull = add("pull", "fetch and convert a model into the cache (default: the embedded one)")
    pull.add_argument("model", nargs="?", default=None,
                      help="alias, HF folder, .gguf file or hub id (default: smollm2-135m, embedded)")
    add("list", "list the converted models in the cache, with their sizes")
    rm = add("rm", "delete converted models from the cache (they are rebuilt on next use)")
    rm.add_argument("names", nargs="+", metavar="NAME", help="a name that `tokenflow list` shows")

    for name, (module, _run, help_text) in _BENCHES.items():
        bench = add(name, help_text)
        if name == command:
            importlib.import_module(module).add_arguments(bench)
    return parser


def _version() -> str:
    from tokenflow import __version__

    return __version__


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand: the first word that is not a flag (no top-level flag takes a value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def configure_logging(level: str) -> None:
    """Log lines on stderr; progress bars draw there too when it is a terminal, else they log."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)  # a no-op where the app or pytest already configured logging
    logging.getLogger("tokenflow").setLevel(level.upper())


_COMMANDS = {
    "generate": lambda args: anyio.run(_generate, args),
    "chat": lambda args: anyio.run(_chat, args),
    "serve": _serve,
    "plugins": _plugins,
    "pull": _pull,
    "list": _list,
    "rm": _rm,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command_of(argv)).parse_args(argv)
    configure_logging(args.log_level)
    try:
        if args.command in _BENCHES:
            module, run, _help = _BENCHES[args.command]
            getattr(importlib.import_module(module), run)(args)
        else:
            _COMMANDS[args.command](args)
    except TokenflowError as exc:
        print(f"tokenflow: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except UsageError as exc:
        print(f"tokenflow {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
