"""The `tokenflow` command: generate, chat, serve, plugins, pull, and the benchmarks (bench, bench-*)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from typing import Any

import anyio

from tokenflow.errors import TokenflowError

__all__ = ("main",)

_SAMPLING_FLAGS: tuple[tuple[str, type], ...] = (
    ("max_tokens", int), ("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float),
    ("repetition_penalty", float), ("presence_penalty", float), ("frequency_penalty", float), ("seed", int),
    ("logprobs", int), ("timeout", float),
)


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", help="alias, HF folder, .gguf file or hub id (default: smollm2-135m)")
    p.add_argument("--config", help="TOML file of engine settings")
    p.add_argument("--backend", help="paged (default) or hf")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other engine setting, e.g. --set max_num_seqs=8")


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    for name, kind in _SAMPLING_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=kind, dest=name)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", default=None)


def _engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for name in ("model", "backend", "dtype", "device", "max_model_len"):
        if getattr(args, name, None) is not None:
            settings[name] = getattr(args, name)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        settings[key.strip()] = json.loads(value) if value[:1] in "[{" else value
    return settings


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {name: getattr(args, name) for name, _ in _SAMPLING_FLAGS if getattr(args, name) is not None}
    if args.stop:
        kwargs["stop"] = args.stop
    if args.ignore_eos:
        kwargs["ignore_eos"] = True
    return kwargs


def _make_engine(args: argparse.Namespace) -> Any:
    from tokenflow.engine import Engine

    return Engine(config_file=args.config, **_engine_settings(args))


async def _generate(args: argparse.Namespace) -> None:
    kwargs = _sampling(args)
    started = time.perf_counter()
    async with _make_engine(args) as engine:
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
    async with _make_engine(args) as engine:
        print("tokenflow chat — empty line or Ctrl-D to quit", file=sys.stderr)
        while True:
            try:
                line = await anyio.to_thread.run_sync(input, "you> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append({"role": "user", "content": line})
            reply = []
            print("bot> ", end="", flush=True)
            async for chunk in engine.stream_chat(history, **kwargs):
                print(chunk.text, end="", flush=True)
                reply.append(chunk.text)
            print()
            history.append({"role": "assistant", "content": "".join(reply)})


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from tokenflow.serve.openai_app import create_app

    http = dict(api_key=args.api_key, max_request_bytes=args.max_request_bytes, cors_origins=args.cors_origin or (),
                report_cached_tokens=args.report_cached_tokens, trusted_client_fields=args.trust_client_field or ())
    app = create_app(config_file=args.config, **http, **_engine_settings(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


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
        group = {registry.STAGES: "stage", registry.BACKENDS: "backend", registry.POLICIES: "policy"}[info.group]
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
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--json", action="store_true", help="print the whole Completion as JSON")
    gen.add_argument("--verbose", "-v", action="store_true", help="print load and generation times")
    _engine_flags(gen)
    _sampling_flags(gen)

    chat = sub.add_parser("chat", help="an interactive chat that keeps the conversation")
    chat.add_argument("--system", help="a system prompt")
    _engine_flags(chat)
    _sampling_flags(chat)

    sub.add_parser("plugins", help="list the stages and backends the registry finds")

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (uvicorn) around one engine")
    _engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", help="require `Authorization: Bearer KEY` (default: $TOKENFLOW_API_KEY; none)")
    serve.add_argument("--max-request-bytes", type=int, default=4 * 2**20, help="larger bodies get 413")
    serve.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                       help="a browser origin allowed to call the API (repeatable; none by default)")
    serve.add_argument("--report-cached-tokens", action="store_true",
                       help="report usage.prompt_tokens_details.cached_tokens (tells callers what others sent)")
    serve.add_argument("--trust-client-field", action="append", choices=["priority", "cache_salt"],
                       help="let clients set this field themselves (repeatable)")

    pull = sub.add_parser("pull", help="fetch and convert a model into the cache (default: the embedded one)")
    pull.add_argument("model", nargs="?", default=None)

    for name, (module, _run, help_text) in _BENCHES.items():
        importlib.import_module(module).add_arguments(sub.add_parser(name, help=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            anyio.run(_generate, args)
        elif args.command == "chat":
            anyio.run(_chat, args)
        elif args.command == "serve":
            _serve(args)
        elif args.command == "plugins":
            _plugins(args)
        elif args.command == "pull":
            _pull(args)
        elif args.command in _BENCHES:
            module, run, _help = _BENCHES[args.command]
            getattr(importlib.import_module(module), run)(args)
    except TokenflowError as exc:
        print(f"tokenflow: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
