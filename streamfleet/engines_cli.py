"""`streamfleet engines …`: build TensorRT plans here or on a GPU build queue, list them,
run a build worker.

    streamfleet engines build tiny-gpt                 build here (needs TensorRT and a GPU)
    streamfleet engines build tiny-gpt --queue sm90    enqueue on sf:arq:build:sm90 (any host)
    streamfleet engines worker --queue sm90            on a GPU host: run those builds
    streamfleet engines list                           what is built where (from Redis)
    streamfleet engines import ./exported --name mymodel   an Optimum export -> engines/mymodel
    streamfleet engines import ./all-MiniLM-L6-v2          a sentence-transformers BERT -> an embedding model

Connection, key prefix and model repository come from ``--redis-url`` / ``--state`` /
``SF_REDIS_URL`` / ``REDIS_URL`` (``streamfleet/local.py``), ``SF_KEY_PREFIX`` and
``SF_ENGINES_DIR``.
See docs/tensorrt.md.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import TYPE_CHECKING, Any

import typer

from streamfleet.clihelp import App
from streamfleet.local import REDIS_FLAG_HELP, STATE_FLAG_HELP

if TYPE_CHECKING:
    from pathlib import Path

    from streamfleet.shared.modelrepo import ModelSpec
    from streamfleet.shared.settings import CommonSettings

__all__ = ["engines_app"]

engines_app = App(no_args_is_help=True,
                  help="Model folders: import an ONNX export, a GGUF or a sentence-transformers model; their "
                       "modes' quality; TensorRT plans: build (here or on a GPU queue), list, a build worker.")



def _settings(redis_url: str | None, state: str | None) -> CommonSettings:
    from streamfleet.local import admin_settings

    return admin_settings(redis_url, state)


def _parse_options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--option {pair!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _when(ts: str | float | None) -> str:
    if ts is None:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ts)))
    except (TypeError, ValueError):
        return "-"


@engines_app.command("build")
def build(
    model: str = typer.Argument(..., help="model folder under engines/"),
    queue: str | None = typer.Option(None, "--queue", metavar="QUEUE", help="enqueue on this GPU-architecture "
                                        "queue (e.g. sm90) for `streamfleet engines worker` instead of building here"),
    force: bool = typer.Option(False, "--force", help="rebuild even when the plan exists"),
    wait: bool = typer.Option(False, "--wait", help="with --queue: wait for the build and print its record"),
    timeout: float = typer.Option(3 * 3600, metavar="SECONDS", help="with --wait: seconds to wait"),
    option: list[str] = typer.Option([], "--option", metavar="KEY=VALUE",
                                     help="KEY=VALUE overriding the tensorrt table of engine.toml (repeatable)"),
    redis_url: str | None = typer.Option(None, "--redis-url", metavar="URL", help=REDIS_FLAG_HELP),
    state: str | None = typer.Option(None, "--state", metavar="PATH", help=STATE_FLAG_HELP),
) -> None:
    """Build MODEL's TensorRT plan for this host's GPU, or queue the build for a GPU host."""
    settings = _settings(redis_url, state)
    options = _parse_options(option)
    if queue:
        raise typer.Exit(_enqueue(settings, queue, model, force, options, wait, timeout))
    raise typer.Exit(_build_here(settings, model, force, options))


def _enqueue(settings: CommonSettings, queue: str, model: str, force: bool, options: dict[str, Any], wait: bool,
             timeout: float) -> int:
    from streamfleet.shared.redis import BROKER_ERRORS
    from streamfleet.workers.enginebuild import enqueue_build, queue_key

    try:
        qkey = queue_key(settings.key_prefix, queue)
    except ValueError as exc:
        raise _fail(str(exc), 2) from None

    async def main() -> int:
        from arq import create_pool
        from arq.connections import RedisSettings

        pool = await create_pool(RedisSettings.from_dsn(settings.redis_url))
        try:
            job = await enqueue_build(pool, settings.key_prefix, queue, model, force=force, options=options)
            typer.echo(f"queued build of {model} on {qkey}: job {job.job_id}", err=True)
            if not wait:
                typer.echo(job.job_id)
                return 0
            try:
                record = await job.result(timeout=timeout, poll_delay=1.0)
            except TimeoutError:
                typer.echo(f"error: no result within {timeout:g}s (is `streamfleet engines worker --queue {queue}` "
                           f"running?)", err=True)
                return 1
            except Exception as exc:  # the job's own exception, re-raised by arq
                typer.echo(f"error: the build failed: {type(exc).__name__}: {exc}", err=True)
                return 1
            typer.echo(json.dumps(record, indent=2))
            return 0
        finally:
            await pool.aclose()

    try:
        return asyncio.run(main())
    except BROKER_ERRORS as exc:
        raise _fail(f"cannot reach Redis at {settings.redis_url}: {exc}") from None


def _build_here(settings: CommonSettings, model: str, force: bool, options: dict[str, Any]) -> int:
    from streamfleet.shared.errors import FatalError, NotFoundError
    from streamfleet.shared.modelrepo import ModelRepository, ensure_artifacts
    from streamfleet.workers.engines.trt_build import build_plan

    try:
        spec = ModelRepository(settings.engines_dir).get(model)
        ensure_artifacts(spec)
        result = build_plan(spec, force=force, options=options or None,
                            log=lambda s: typer.echo(s, err=True))
    except NotFoundError as exc:
        raise _fail(exc.message, 2) from None
    except FatalError as exc:
        raise _fail(exc.message) from None
    record = result.record()
    typer.echo(f"{'built' if result.built else 'found'} {result.path}", err=True)
    _record_best_effort(settings, model, result.key, record)
    typer.echo(json.dumps(record, indent=2))
    return 0


def _record_best_effort(settings: CommonSettings, model: str, key: str, record: dict[str, Any]) -> None:
    """Local builds show up in `engines list` too, when Redis is reachable."""
    from streamfleet.shared.redis import BROKER_ERRORS, connect
    from streamfleet.shared.schema import encode_plan_record
    from streamfleet.workers.enginebuild import plans_key

    async def main() -> None:
        client = connect(settings.redis_url, cluster=settings.redis_cluster, socket_timeout=2.0)
        try:
            await client.hset(plans_key(settings.key_prefix, model), key, encode_plan_record(record))
        finally:
            await client.aclose()

    try:
        asyncio.run(main())
    except BROKER_ERRORS as exc:
        typer.echo(f"note: not recorded in Redis ({settings.redis_url}: {exc})", err=True)


@engines_app.command("list")
def list_(
    model: str | None = typer.Argument(None, help="only this model"),
    as_json: bool = typer.Option(False, "--json", help="one JSON document instead of tables"),
    local: bool = typer.Option(False, "--local", help="also list plan files on this host's disk"),
    redis_url: str | None = typer.Option(None, "--redis-url", metavar="URL", help=REDIS_FLAG_HELP),
    state: str | None = typer.Option(None, "--state", metavar="PATH", help=STATE_FLAG_HELP),
) -> None:
    """Show built plans (host, TensorRT, GPU arch, when, how long) and the build queues."""
    from streamfleet.shared.redis import BROKER_ERRORS, connect
    from streamfleet.workers.enginebuild import list_plans, list_queues

    settings = _settings(redis_url, state)

    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        client = connect(settings.redis_url, cluster=settings.redis_cluster,
                         socket_timeout=settings.redis_socket_timeout_s)
        try:
            return (await list_plans(client, settings.key_prefix, model),
                    await list_queues(client, settings.key_prefix))
        finally:
            await client.aclose()

    try:
        plans, queues = asyncio.run(main())
    except BROKER_ERRORS as exc:
        raise _fail(f"cannot reach Redis at {settings.redis_url}: {exc}") from None
    files = _local_plans(settings, model) if local else []
    if as_json:
        doc: dict[str, Any] = {"plans": plans, "queues": queues}
        if local:
            doc["local"] = files
        typer.echo(json.dumps(doc, indent=2))
        return
    if plans:
        _table(("MODEL", "KEY", "HOST", "TRT", "ARCH", "BUILT", "SECONDS", "PATH"),
               [(p.get("model"), str(p.get("key", ""))[:16], p.get("host"), p.get("trt_version"),
                 f"sm{p.get('cc')}", _when(p.get("built_at")), p.get("seconds"), p.get("path")) for p in plans])
    else:
        typer.echo("no plans recorded" + (f" for {model}" if model else ""), err=True)
    if queues:
        typer.echo("")
        _table(("QUEUE", "QUEUED", "WORKER HEALTH"),
               [(q["queue"], q["queued"], q["health"] or "no worker seen") for q in queues])
    if local:
        typer.echo("")
        if files:
            _table(("MODEL", "KEY", "TRT", "ARCH", "MB", "PATH"),
                   [(f["model"], str(f.get("key") or "?")[:16], f.get("trt_version") or "?", f"sm{f.get('cc')}",
                     round(f["bytes"] / 1e6, 1), f["path"]) for f in files])
        else:
            typer.echo("no plan files on this host", err=True)


def _local_plans(settings: CommonSettings, model: str | None) -> list[dict[str, Any]]:
    from streamfleet.shared.errors import FatalError, NotFoundError
    from streamfleet.shared.modelrepo import ModelRepository
    from streamfleet.workers.engines.trt_plan import list_local_plans, tensorrt_options

    repo = ModelRepository(settings.engines_dir)
    out = []
    for name in [model] if model else repo.names():
        try:
            spec = repo.get(name)
            out.extend(list_local_plans(spec, tensorrt_options(spec)))
        except (NotFoundError, FatalError) as exc:
            typer.echo(f"note: {name}: {exc.message}", err=True)
    return out


def _table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
    cells = [[("-" if c is None else str(c)) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


@engines_app.command("worker")
def worker(
    queue: str = typer.Option(..., "--queue", metavar="QUEUE", help="the GPU-architecture queue to serve, e.g. sm90"),
    burst: bool = typer.Option(False, "--burst", help="exit once the queue is empty"),
    check_arch: bool = typer.Option(True, "--check-arch/--no-check-arch",
                                    help="refuse to serve an smNN queue that is not this GPU's architecture"),
    redis_url: str | None = typer.Option(None, "--redis-url", metavar="URL", help=REDIS_FLAG_HELP),
    state: str | None = typer.Option(None, "--state", metavar="PATH", help=STATE_FLAG_HELP),
) -> None:
    """Run build jobs from QUEUE on this GPU host (arq worker; one build at a time)."""
    import re

    from streamfleet.shared.errors import FatalError
    from streamfleet.shared.logging import configure_logging
    from streamfleet.workers.enginebuild import make_worker, queue_key

    settings = _settings(redis_url, state)
    configure_logging(settings.log_level, settings.log_format, process="engine-builder")
    try:
        qkey = queue_key(settings.key_prefix, queue)
    except ValueError as exc:
        raise _fail(str(exc), 2) from None
    m = re.fullmatch(r"sm(\d+)", queue)
    if check_arch and m:
        from streamfleet.workers.engines.cuda_mem import detect_compute_capability

        try:
            cc = detect_compute_capability()
        except FatalError as exc:
            raise _fail(f"{exc.message}; a build worker runs on a GPU host (or pass --no-check-arch)") from None
        if cc != m.group(1):
            raise _fail(f"this GPU is sm{cc}, not {queue}: plans built here would not run on {queue} hosts "
                        f"(serve --queue sm{cc}, or pass --no-check-arch)", 2)
    typer.echo(f"serving {qkey}", err=True)
    w = make_worker(redis_url=settings.redis_url, prefix=settings.key_prefix, queue=queue,
                    engines_dir=settings.engines_dir, burst=burst)
    w.run()
    sys.exit(0)


@engines_app.command("import", help=(
    "Check an Optimum ONNX export and copy it into the model repository as a servable model folder, or build one "
    "from a Llama GGUF file (graph, tokenizer, chat template) or from a sentence-transformers BERT model (an "
    "embedding model: graph and tokenizer); prints what it found (layout, KV heads and dtype, position_ids, "
    "context and what capped it, EOS and BOS, where the chat template comes from; for an embedding model its "
    "layers, pooling, normalisation and context)."))
def import_(
    path: str = typer.Argument(..., help="a folder exported by `optimum-cli export onnx --task "
                                         "text-generation-with-past`, a Llama GGUF file (FILE.gguf), or a "
                                         "sentence-transformers folder (modules.json, model.safetensors; or a "
                                         "zip of one)"),
    name: str | None = typer.Option(None, "--name", metavar="NAME", help="model name (default: the folder's name)"),
    engines_dir: str | None = typer.Option(None, "--engines-dir", metavar="PATH", help="model repository "
                                              "[SF_ENGINES_DIR, default engines/]"),
    backend: str = typer.Option("onnxruntime", "--backend", help="onnxruntime | tensorrt"),
    max_batch: int | None = typer.Option(None, "--max-batch", min=1, metavar="N",
                                            help="sequences one worker runs at once (default 16; an embedding "
                                                 "model: inputs one run embeds, default 64)"),
    max_context: int | None = typer.Option(None, "--max-context", min=2, metavar="TOKENS",
                                              help="prompt + completion tokens, or an embedding model's tokens "
                                                   "per input (default: the model's, at most 4096)"),
    check_only: bool = typer.Option(False, "--check", help="check and describe, copy nothing"),
    force: bool = typer.Option(False, "--force", help="replace a model folder of that name"),
    weights: str = typer.Option("q4", "--weights", help="GGUF only: q4 (4-bit weights, fp32 activations) | fp32 "
                                "(the reference path) | int8 | q4-int8act (lossy) | auto (a graph each for q4, "
                                "q4-int8act and fp32; the fastest that passes the quality gate serves, measured "
                                "on each CPU; docs/models.md)"),
    max_kld: float | None = typer.Option(None, "--max-kld", min=0.0, metavar="KLD",
                                            help="with --weights auto: the mean KL divergence from fp32 a lossy mode "
                                                 "(q4-int8act) may have and serve; without it only the modes exact "
                                                 "in the weights (q4, fp32) are candidates"),
) -> None:
    from pathlib import Path

    from streamfleet.modelimport import import_export, inspect_export
    from streamfleet.shared.errors import FatalError
    from streamfleet.shared.modelrepo import ModelRepository
    from streamfleet.shared.settings import CommonSettings

    if backend not in ("onnxruntime", "tensorrt"):
        raise _fail(f"--backend must be onnxruntime or tensorrt, got {backend!r}", 2)
    source = Path(path)
    if source.suffix.lower() == ".gguf" or (source.is_file() and _magic(source) == b"GGUF"):
        _import_gguf(source, name, engines_dir, backend, max_batch or 16, max_context, check_only, force, weights,
                     max_kld)
        return
    if max_kld is not None:
        raise _fail("--max-kld goes with a GGUF file's --weights auto", 2)
    from streamfleet.shared.bertimport import is_checkpoint

    if is_checkpoint(source):
        _import_embedding(source, name, engines_dir, backend, max_batch or 64, max_context, check_only, force)
        return
    max_batch = max_batch or 16
    model_name = name or source.resolve().name
    try:
        if check_only:
            typer.echo(inspect_export(source, backend=backend, max_context=max_context).describe())
            return
        root = ModelRepository(engines_dir or CommonSettings().engines_dir).root
        dest, found = import_export(source, root, model_name, backend=backend, max_batch=max_batch,
                                    max_context=max_context, force=force)
    except FatalError as exc:
        raise _fail(str(exc)) from None
    typer.echo(found.describe())
    typer.echo(f"\nimported as {model_name!r} into {dest}; serve it with: streamfleet worker --model {model_name}")


def _import_embedding(source: Path, name: str | None, engines_dir: str | None, backend: str, max_batch: int,
                      max_context: int | None, check_only: bool, force: bool) -> None:
    """A sentence-transformers model (a folder, or a zip of one) -> an embedding model
    folder (shared/bertimport.py; docs/models.md, "Embedding models")."""
    from streamfleet.shared.bertimport import context_for, import_sentence_transformers, read_checkpoint
    from streamfleet.shared.errors import FatalError
    from streamfleet.shared.modelrepo import ModelRepository
    from streamfleet.shared.settings import CommonSettings

    if backend != "onnxruntime":
        raise _fail("a sentence-transformers model imports for --backend onnxruntime only", 2)
    stem = source.resolve().name
    model_name = name or (stem.rsplit(".", 1)[0] if source.is_file() else stem).lower().replace(".", "-")
    try:
        if check_only:
            model = read_checkpoint(source)
            typer.echo(model.describe(*context_for(model, max_context)))  # refuses a --max-context over the model's
            return
        root = ModelRepository(engines_dir or CommonSettings().engines_dir).root
        typer.echo(f"importing {source} ...", err=True)
        dest, description = import_sentence_transformers(source, root, model_name, max_batch=max_batch,
                                                         max_context=max_context, force=force)
    except FatalError as exc:
        raise _fail(str(exc)) from None
    typer.echo(description)
    typer.echo(f"\nimported as {model_name!r} into {dest}: an embedding model (vectors; no text generation)")


def _magic(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError:
        return b""


def _import_gguf(source: Path, name: str | None, engines_dir: str | None, backend: str, max_batch: int,
                 max_context: int | None, check_only: bool, force: bool, weights: str,
                 max_kld: float | None = None) -> None:
    import tempfile
    from pathlib import Path

    from streamfleet.shared.errors import FatalError
    from streamfleet.shared.execution import import_auto
    from streamfleet.shared.ggufimport import AUTO, WEIGHT_MODES, context_for, import_gguf, read_gguf
    from streamfleet.shared.modelrepo import ModelRepository
    from streamfleet.shared.settings import CommonSettings

    if backend != "onnxruntime":
        raise _fail("a GGUF file imports for --backend onnxruntime only", 2)
    if weights not in WEIGHT_MODES and weights != AUTO:
        raise _fail(f"--weights must be auto or one of {', '.join(WEIGHT_MODES)}, got {weights!r}", 2)
    if max_kld is not None and weights != AUTO:
        raise _fail("--max-kld goes with --weights auto (the quality gate of the modes it chooses among)", 2)
    model_name = name or source.name.rsplit(".", 1)[0].lower().replace(".", "-")
    try:
        if check_only and weights != AUTO:
            model = read_gguf(source)
            typer.echo(model.describe(weights, *context_for(model, max_context)))
            return
        if check_only:  # auto: the modes measured in a scratch folder, nothing kept
            with tempfile.TemporaryDirectory(prefix="sf-check-") as tmp:
                _, description = import_auto(source, Path(tmp), model_name, max_batch=max_batch,
                                             max_context=max_context, force=True, max_kld=max_kld, say=_say)
                typer.echo(description)
                _measure_and_describe(ModelRepository(Path(tmp)).get(model_name))
            return
        root = ModelRepository(engines_dir or CommonSettings().engines_dir).root
        typer.echo(f"importing {source} ({weights} weights) ...", err=True)
        if weights == AUTO:
            dest, description = import_auto(source, root, model_name, max_batch=max_batch, max_context=max_context,
                                            force=force, max_kld=max_kld, say=_say)
        else:
            dest, description = import_gguf(source, root, model_name, weights=weights, max_batch=max_batch,
                                            max_context=max_context, force=force)
        typer.echo(description)
        if weights == AUTO:
            _measure_and_describe(ModelRepository(root).get(model_name))
    except FatalError as exc:
        raise _fail(str(exc)) from None
    typer.echo(f"\nimported as {model_name!r} into {dest}; serve it with: streamfleet serve --model {model_name}")


def _say(line: str) -> None:
    typer.echo(f"  {line}", err=True)


def _measure_and_describe(spec: ModelSpec, *, threads: int | None = None, fresh: bool = False,
                          chunks: int | None = None) -> None:
    """Measure an ``auto`` folder's modes (what its record lacks, everything with
    ``fresh``) and print the table: which mode serves on this CPU, and why."""
    from streamfleet.shared import execution
    from streamfleet.shared.modelrepo import auto_stamp

    if fresh:
        (spec.path / execution.EXECUTION_FILE).unlink(missing_ok=True)
    record = execution.measure(spec, auto_stamp(spec), threads=threads, say=_say, chunks=chunks)
    typer.echo("")
    for line in execution.describe(record):
        typer.echo(line)


@engines_app.command("quality", help=(
    "Measure a weights = \"auto\" model's execution modes the way llama.cpp's llama-perplexity does: perplexity, "
    "mean KL divergence and same-top-1 rate against its fp32 path over a fixed English text "
    "(shared/corpus/alice.txt), and each mode's decode step at batch 1 and 16 on this CPU; prints the table and "
    "which mode serves here, and why (docs/models.md, \"Execution modes\"). Rewrites the model's execution.json."))
def quality(
    model: str = typer.Argument(..., help="a model folder with weights = \"auto\" (smollm2-135m)"),
    engines_dir: str | None = typer.Option(None, "--engines-dir", metavar="PATH", help="model repository "
                                              "[SF_ENGINES_DIR, default engines/]"),
    threads: int | None = typer.Option(None, "--threads", min=1, metavar="N",
                                          help="ONNX Runtime threads (default: all cores)"),
    chunks: int | None = typer.Option(None, "--chunks", min=1, metavar="N",
                                         help="score only the first N chunks of 512 tokens (default: all 11)"),
) -> None:
    from streamfleet.shared import execution
    from streamfleet.shared.errors import FatalError, NotFoundError
    from streamfleet.shared.modelrepo import ModelRepository, ensure_artifacts
    from streamfleet.shared.settings import CommonSettings

    repo = ModelRepository(engines_dir or CommonSettings().engines_dir)
    try:
        spec = repo.get(model)
    except NotFoundError:
        raise _fail(repo.missing(model), 2) from None
    if spec.options.get("weights") != execution.AUTO:
        raise _fail(f"model {model!r} has weights = {spec.options.get('weights', 'none')!r}, one mode pinned: "
                    f"`streamfleet engines quality` compares the modes of a weights = \"auto\" folder (import "
                    f"a GGUF file with --weights auto, or set weights = \"auto\" in its engine.toml)", 2)
    try:
        measured = (spec.path / execution.EXECUTION_FILE).exists()
        ensure_artifacts(spec)  # fetched, imported and measured on first use, as a worker would
        _measure_and_describe(spec, threads=threads, fresh=measured, chunks=chunks)
    except FatalError as exc:
        raise _fail(str(exc)) from None
