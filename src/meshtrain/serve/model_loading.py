"""What ``meshtrain serve MODEL`` loads: the model, its tokenizer and its task.

MODEL is recognised by what the folder holds, checked in this order:

* ``manifest.json`` (one meshtrain checkpoint tag) or a ``latest`` file (a meshtrain
  save_dir; ``--tag`` picks another tag): a **sharded** checkpoint. The model class and
  config come from the checkpoint meta (``hf_model_class``, ``hf_config``, written by
  ``engine.save_checkpoint`` for ``transformers`` models); every tensor is assembled from
  the rank files that hold its pieces (``CheckpointReader.read_full``), whatever mesh or
  ZeRO stage wrote them -- no conversion step. Peak memory: the model plus one tensor.
* ``config.json``: a ``save_pretrained`` folder, which includes a Trainer
  ``checkpoint-N`` folder (it holds ``config.json`` and the weights beside the trainer
  state); loaded with ``from_pretrained``.
* ``checkpoint-N`` sub-folders only (a Trainer ``output_dir``): the largest N is served.
* a ``meshtrain train`` output folder (``checkpoints/`` beside a ``model/`` folder with
  ``config.json``): ``model/``, the ``save_pretrained`` export the job writes at its end
  (``meshtrain.jobs.train.serving_export``). Checked before ``config.json``, which in
  that folder is the job's config, not a model's.

The task is read from the architecture (``...ForSequenceClassification`` ->
``text-classification``, ``...ForCausalLM`` / ``...LMHeadModel`` -> ``chat``) unless
``--task`` says it; a task that the weights do not cover (a head that would be freshly,
randomly initialised) is refused. The tokenizer comes from ``--tokenizer``, or the first
of these folders holding one: MODEL (the tag directory), then its parent (the save_dir
or the Trainer ``output_dir``).

The model is moved to ``--device`` once loaded: ``auto`` (the default) is the first CUDA
device when torch sees one, else the CPU. The continuous batcher, its paged key/value
cache and the classifier put their tensors on the model's device; only HTTP, JSON and
tokenization stay on the CPU (in their own process for chat: ``split_process``).

Every failure raises :class:`~meshtrain.errors.ServeError` naming the path and the fix,
before the server binds its port.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshtrain.dtypes import PRECISIONS
from meshtrain.errors import CheckpointError, ServeError
from meshtrain.files.tokenizer_files import check_tokenizer_files
from meshtrain.jobs.train.serving_export import EXPORT_DIR as TRAIN_EXPORT
from meshtrain.serve import diagnose

TASKS = ("text-classification", "chat")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenizer.model")
_CHECKPOINT_N = re.compile(r"^checkpoint-(\d+)$")
_TASK_SUFFIXES = {
    "text-classification": ("ForSequenceClassification",),
    "chat": ("ForCausalLM", "LMHeadModel"),
}


@dataclass
class ServedModel:
    """A model ready to answer: in eval mode, with its tokenizer and what it was loaded from."""

    model: Any
    tokenizer: Any
    task: str
    source: str  # one line for logs and ``GET /``: what was loaded from where
    path: Path
    context_length: int | None
    dtype: torch.dtype
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Resolved:
    """Which kind of folder MODEL is, and the folder to load (see the module docstring)."""

    kind: str  # "meshtrain" | "pretrained"
    path: Path
    tag: str | None = None
    note: str = ""


def resolve(model: str | os.PathLike, tag: str | None = None) -> Resolved:
    """Decide what MODEL is from the files it holds; raise ServeError when nothing fits."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ServeError(
            f"MODEL {str(path)!r} does not exist; pass a save_pretrained folder, a meshtrain "
            f"checkpoint directory (with 'latest') or a Trainer checkpoint-N folder"
        )
    if not path.is_dir():
        raise ServeError(
            f"MODEL {str(path)!r} is a file; pass the folder that holds it (a save_pretrained "
            f"folder with config.json, or a meshtrain checkpoint directory)"
        )
    if (path / "manifest.json").is_file() or (path / "latest").is_file() or tag is not None:
        return Resolved("meshtrain", path, tag)
    export = path / TRAIN_EXPORT
    if (path / "checkpoints").is_dir() and (export / "config.json").is_file():
        return Resolved("pretrained", export, note="the model meshtrain train exported")
    if (path / "config.json").is_file():
        return Resolved("pretrained", path)
    numbered = sorted(
        (int(m.group(1)), p)
        for p in path.iterdir()
        if p.is_dir() and (m := _CHECKPOINT_N.match(p.name))
    )
    if numbered:
        newest = numbered[-1][1]
        inner = resolve(newest)
        note = f"newest of {len(numbered)} Trainer checkpoints"
        return Resolved(inner.kind, inner.path, inner.tag, note)
    found = sorted(p.name for p in path.iterdir())[:8]
    raise ServeError(
        f"MODEL {str(path)!r} is neither a save_pretrained folder (no config.json), a meshtrain "
        f"checkpoint (no manifest.json or 'latest') nor a Trainer output_dir (no checkpoint-N "
        f"folders); it holds {found or 'nothing'}"
    )


def task_of(architectures: list[str] | None) -> str | None:
    """The task an architecture name implies, or None when it implies none of ours."""
    for name in architectures or []:
        for task, suffixes in _TASK_SUFFIXES.items():
            if name.endswith(suffixes):
                return task
    return None


def _pick_task(task: str | None, architectures: list[str] | None, where: Path) -> str:
    implied = task_of(architectures)
    if task is None:
        if implied is None:
            raise ServeError(
                f"{where}: cannot tell the task from architectures {architectures}; pass "
                f"--task text-classification or --task chat"
            )
        return implied
    if task not in TASKS:
        raise ServeError(f"--task {task!r} is not supported; use one of {list(TASKS)}")
    if implied is not None and implied != task:
        raise ServeError(
            f"{where} holds a {architectures[0]} ({implied}), which cannot serve --task {task}; "
            f"pass --task {implied} or a model trained for {task}"
        )
    return task


def _dtype_arg(dtype: str | None) -> torch.dtype | None:
    if dtype in (None, "auto"):
        return None
    if dtype not in PRECISIONS:
        raise ServeError(
            f"--dtype {dtype!r} is not supported; use auto or one of {sorted(PRECISIONS)}"
        )
    return PRECISIONS[dtype]


def device_arg(device: str | None) -> torch.device:
    """``--device``: ``auto`` (or None) is ``cuda`` when torch sees a CUDA device, else
    ``cpu``; ``cpu``, ``cuda`` and ``cuda:N`` are checked against what torch sees."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ServeError(
            f"--device {device!r} is not a device; use auto, cpu, cuda or cuda:N"
        ) from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ServeError(f"--device {device!r}: meshtrain serve runs on cpu or cuda devices")
    if not torch.cuda.is_available():
        raise ServeError(
            f"--device {device}: torch {torch.__version__} sees no CUDA device "
            f"(torch.cuda.is_available() is False); serve with --device cpu, or install a "
            f"CUDA build of torch on a machine with a GPU"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ServeError(
            f"--device {device}: torch sees {count} CUDA device(s), cuda:0..cuda:{count - 1}"
        )
    return dev


def _load_pretrained(res: Resolved, task: str | None, dtype: torch.dtype | None):
    import transformers

    from meshtrain.checkpoint.tensor_files import check_folder

    check_folder(res.path, ServeError)  # checksums of an export, else headers/sizes/dtypes
    try:
        config = transformers.AutoConfig.from_pretrained(res.path)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError/ValueError/KeyError variants
        fix = "save the model again with save_pretrained"
        why = diagnose.bad_json(res.path, ("config.json",), fix)
        raise ServeError(why or f"{res.path}/config.json cannot be loaded: {exc}") from None
    task = _pick_task(task, config.architectures, res.path)
    if (why := diagnose.missing_weights(res.path)) is not None:
        raise ServeError(why)
    auto = (
        transformers.AutoModelForSequenceClassification
        if task == "text-classification"
        else transformers.AutoModelForCausalLM
    )
    try:
        model, info = auto.from_pretrained(
            res.path, dtype=dtype or "auto", output_loading_info=True
        )
    except Exception as exc:  # noqa: BLE001 - transformers' many error types, diagnosed below
        why = diagnose.damaged_weights(res.path, exc)
        if why is None and "mismatched_sizes" in str(exc):
            why = diagnose.shape_mismatch(res.path, auto, config)
        raise ServeError(
            why or f"{res.path}: the model cannot be loaded for {task}: {exc}"
        ) from None
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise ServeError(
            f"{res.path}: the weights lack {len(missing)} tensor(s) a {type(model).__name__} needs "
            f"({', '.join(missing[:5])}); they would be random. Serve a model trained for {task}"
        )
    return model, task, f"save_pretrained folder {res.path}"


def _load_sharded(res: Resolved, task: str | None, dtype: torch.dtype | None):
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from meshtrain.checkpoint import CheckpointReader, dtype_from_name

    try:
        reader = CheckpointReader(res.path, res.tag)
    except CheckpointError as exc:
        raise ServeError(f"MODEL {str(res.path)!r}: {exc}") from None
    with reader:
        meta = reader.meta
        hf_config, cls_name = meta.get("hf_config"), meta.get("hf_model_class")
        if not hf_config or not cls_name:
            raise ServeError(
                f"checkpoint {reader.path} was not saved from a transformers model (its meta has "
                f"no hf_config/hf_model_class); serve needs one: train a transformers model, "
                f"or export yours with save_pretrained"
            )
        task = _pick_task(task, [cls_name], reader.path)
        if task_of([cls_name]) is None:
            raise ServeError(
                f"checkpoint {reader.path} holds a {cls_name}, which has no head for {task}; "
                f"serve a ...ForSequenceClassification or ...ForCausalLM model"
            )
        cls = getattr(transformers, cls_name, None)
        model_type = hf_config.get("model_type")
        if cls is None or model_type not in CONFIG_MAPPING:
            raise ServeError(
                f"checkpoint {reader.path}: model class {cls_name!r} (model_type "
                f"{model_type!r}) is not in this transformers {transformers.__version__}"
            )
        config = CONFIG_MAPPING[model_type].from_dict(hf_config)
        model = cls(config)  # fp32 init; every tensor is then overwritten from the shards
        state = model.state_dict()
        reader.check_model({k: tuple(v.shape) for k, v in state.items()})
        aliases = reader.aliases
        with torch.no_grad():
            for name in reader.names():
                state[name].copy_(reader.read_full(name))
                reader.release()  # keep memory at the model plus one tensor
        model.tie_weights()  # tied aliases share storage again, as in the saved model
        floats = [t["dtype"] for t in meta["tensors"].values() if "float" in t["dtype"]]
        model_dtype = dtype or (dtype_from_name(floats[0]) if floats else torch.float32)
        model = model.to(model_dtype)
        stage, mesh = meta.get("zero_stage"), meta.get("mesh", {})
        mesh_text = "x".join(f"{k}{v}" for k, v in mesh.items())
        source = (
            f"meshtrain checkpoint {reader.path} ({reader.world_size} rank files, ZeRO stage "
            f"{stage}, mesh {mesh_text}, step {meta.get('global_steps')}"
            + (f", {len(aliases)} tied" if aliases else "")
            + ")"
        )
        return model, task, source, reader.path


def _tokenizer(explicit: str | None, folders: list[Path]):
    from transformers import AutoTokenizer

    if explicit is not None:
        candidates = [Path(explicit).expanduser()]
        if not candidates[0].exists():
            raise ServeError(f"--tokenizer {explicit!r} does not exist")
    else:
        candidates = [f for f in folders if any((f / n).is_file() for n in TOKENIZER_FILES)]
        if not candidates:
            shown = ", ".join(str(f) for f in folders)
            raise ServeError(
                f"no tokenizer found in {shown}; pass --tokenizer PATH (a folder written by "
                f"tokenizer.save_pretrained)"
            )
    fix = "save the tokenizer again with tokenizer.save_pretrained, or pass --tokenizer"
    check_tokenizer_files(candidates[0], ServeError, fix=fix)  # file:line:col, not a traceback
    try:
        return AutoTokenizer.from_pretrained(candidates[0]), candidates[0]
    except Exception as exc:  # noqa: BLE001 - transformers' many error types, diagnosed below
        why = diagnose.bad_json(candidates[0], TOKENIZER_FILES, fix)
        raise ServeError(
            why or f"tokenizer {str(candidates[0])!r} cannot be loaded: {exc}"
        ) from None


def _context_length(model: Any, tokenizer: Any) -> int | None:
    limits = [
        getattr(model.config, k, None)
        for k in ("max_position_embeddings", "n_positions", "max_sequence_length")
    ]
    limits.append(getattr(tokenizer, "model_max_length", None))
    limits = [int(x) for x in limits if isinstance(x, int) and 0 < x < 1_000_000]
    return min(limits) if limits else None


def load(
    model: str | os.PathLike,
    *,
    task: str | None = None,
    tag: str | None = None,
    tokenizer: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
) -> ServedModel:
    """Load MODEL for serving (module docstring). ``dtype``: auto (the saved one), fp32,
    bf16 or fp16. ``device``: auto (CUDA when there is one), cpu, cuda or cuda:N.
    Raises ServeError with the fix on every failure."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ServeError(
            f'serving needs transformers ({exc}); pip install "meshtrain[hf,serve]"'
        ) from None
    res = resolve(model, tag)
    cast = _dtype_arg(dtype)
    dev = device_arg(device)
    if res.kind == "meshtrain":
        net, task, source, where = _load_sharded(res, task, cast)
        folders = [where, where.parent]
    else:
        net, task, source = _load_pretrained(res, task, cast)
        where = res.path
        folders = [where, where.parent]
    if res.note:
        source += f" ({res.note})"
    tok, tok_path = _tokenizer(tokenizer, folders)
    net.to(dev).eval()
    info = {
        "tokenizer": str(tok_path),
        "parameters": sum(p.numel() for p in net.parameters()),
        "device": str(dev),
    }
    return ServedModel(
        model=net,
        tokenizer=tok,
        task=task,
        source=source,
        path=where,
        context_length=_context_length(net, tok),
        dtype=next(net.parameters()).dtype,
        info=info,
    )
