"""Hugging Face checkpoints in and out, and training from a checkpoint's weights (``train.init_from``).

``import_hf``: HF_DIR (config.json, model*.safetensors, model.safetensors.index.json) -> a checkpoint of
the model's logical tensors (torch.distributed.checkpoint, the format training saves), written one tensor
at a time: each is read from its shard, converted (models/hf.py) and written before the next is read, so
memory holds one tensor, never the model. It also holds config.yaml (a training config with
``train.init_from`` pointing at it) and the Hugging Face side files (config.json, tokenizer, generation
config) under ``hf/``, which export gives back.

``export_hf``: a checkpoint -- an import, a step directory, a run's checkpoints root or the run directory,
also while the run is writing new ones -> HF_DIR with config.json, model-0000N-of-0000M.safetensors and
model.safetensors.index.json, written shard by shard (a shard's tensors in memory at a time). Its model
config comes from config.yaml beside the checkpoint (the trainer writes one into every run directory).

``load_model_weights``: a fresh run's model reads its parameters from a checkpoint by logical name, at any
layout: each rank asks only for its experts and its TP blocks, so no rank holds the whole model.

Both readers check every file's size against what its header or the checkpoint's metadata promise, so a
truncated shard fails with its name, before any tensor is converted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import struct
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from tqdm import tqdm

from moe_overlap.config import Config, ConfigError, ModelConfig, config_yaml, load_config
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.layers.param_info import tp_shard
from moe_overlap.models import hf
from moe_overlap.models.hf import HFConversionError, TensorMap
from moe_overlap.models.mixtral import MixtralModel
from moe_overlap.training.checkpoint import LATEST, latest_step, step_dir, tp_logical_tensor
from moe_overlap.training.optimizer import logical_parts

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"  # beside a checkpoint (import) or in a run directory (the trainer writes it)
HF_FILES = "hf"  # the imported model's config.json and tokenizer files, inside an imported checkpoint
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64"}


# --------------------------------------------------------------------------------------- safetensors files


def safetensors_header(path: Path) -> dict:
    """The header of a .safetensors file (tensor name -> dtype, shape, data_offsets), after checking that
    the file is as long as the header says: an interrupted download or copy fails here, by name."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise HFConversionError(f"{path}: {size} bytes, too short for a safetensors header (truncated?)")
        header_len = struct.unpack("<Q", prefix)[0]
        if 8 + header_len > size:
            raise HFConversionError(f"{path}: truncated: {size} bytes, its header alone claims {8 + header_len}")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    data_end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if 8 + header_len + data_end != size:
        raise HFConversionError(f"{path}: truncated or corrupt: {size} bytes, its header describes "
                                f"{8 + header_len + data_end} (an interrupted download or copy?)")
    return header


class HFShards:
    """The tensors of a Hugging Face directory: one model.safetensors, or shards listed by the index."""

    def __init__(self, hf_dir: Path):
        self.dir = hf_dir
        index = hf_dir / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (hf_dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise HFConversionError(f"{hf_dir}: neither {INDEX_FILE} nor model.safetensors (only safetensors "
                                    "checkpoints are read)")
        self.info: dict[str, tuple[str, dict]] = {}  # name -> (file, header entry)
        for file in files:
            if not (hf_dir / file).is_file():
                raise HFConversionError(f"{hf_dir / file}: listed in {INDEX_FILE} but missing")
            for name, entry in safetensors_header(hf_dir / file).items():
                self.info[name] = (file, entry)
        if index.is_file():
            missing = sorted(set(weight_map) - set(self.info))
            if missing:
                raise HFConversionError(f"{hf_dir}: {missing[0]} is listed in {INDEX_FILE} but in none of the "
                                        f"shards ({len(missing)} such tensors)")
        self._open: dict[str, object] = {}

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor of the stored shape and dtype (for planning, no data)."""
        entry = self.info[name][1]
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise HFConversionError(f"{name}: dtype {entry['dtype']} (quantized?): only "
                                    f"{', '.join(_SAFETENSORS_DTYPES)} are read")
        return torch.empty(entry["shape"], dtype=_SAFETENSORS_DTYPES[entry["dtype"]], device="meta")

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read from its shard (memory-mapped: only its bytes)."""
        file = self.info[name][0]
        if file not in self._open:
            self._open[file] = safe_open(str(self.dir / file), framework="pt")
        return self._open[file].get_tensor(name)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
    safetensors_header(path)  # the file is whole


# ------------------------------------------------------------------------------------------- checkpoints


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every single-process save and load, even when asked for one (no_dist=True)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to", category=UserWarning)
        yield


def resolve_checkpoint(path: str | os.PathLike) -> tuple[Path, Path | None]:
    """(step directory, config.yaml or None) of a checkpoint given as a step directory (or an import),
    a checkpoints root (its ``latest``) or a run directory (its config.yaml and checkpoints)."""
    path = Path(path).expanduser()
    if (path / ".metadata").is_file():
        step = path
    elif (path / LATEST).is_file():
        step = _latest(path)
    elif (path / CONFIG_FILE).is_file():
        cfg = load_config(path / CONFIG_FILE)
        root = path / "checkpoints" if (path / "checkpoints").is_dir() else cfg.checkpoint_dir
        step = _latest(root)
    else:
        raise FileNotFoundError(f"{path}: not a checkpoint (no .metadata), a checkpoints root (no {LATEST}) or a "
                                f"run directory (no {CONFIG_FILE})")
    config = next((d / CONFIG_FILE for d in (step, step.parent.parent) if (d / CONFIG_FILE).is_file()), None)
    return step, config


def _latest(root: Path) -> Path:
    step = latest_step(root)
    if step is None:
        raise FileNotFoundError(f"{root}: no complete checkpoint yet")
    return step_dir(root, step)


def checkpoint_metadata(step: Path):
    """The checkpoint's metadata, after checking that every data file is as long as it promises."""
    metadata = FileSystemReader(str(step)).read_metadata()
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in needed.items():
        size = (step / name).stat().st_size if (step / name).is_file() else None
        if size is None or size < length:
            raise HFConversionError(f"{step / name}: {'missing' if size is None else f'truncated: {size} bytes'}, "
                                    f"the checkpoint's metadata needs {length}")
    return metadata


def model_logical_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Every parameter's logical tensor (experts one each) by checkpoint key, from a meta-device model."""
    model = MixtralModel(cfg, Mesh.single(), device="meta", dtype=torch.float32)
    return {f"model.{key}": shape for name, param in model.named_parameters()
            for key, _, shape in logical_parts(name, param)}


def _check_keys(maps: list[TensorMap], shapes: dict[str, torch.Size], found: dict[str, torch.Size],
                where: str) -> None:
    """The tensors ``found`` in a checkpoint are the model's, with its shapes."""
    for key, shape in shapes.items():
        if key not in found:
            raise HFConversionError(f"{where}: {key} is missing (does the model config match the checkpoint?)")
        if tuple(found[key]) != tuple(shape):
            raise HFConversionError(f"{where}: {key} has shape {list(found[key])}, the model config gives "
                                    f"{list(shape)}")
    assert {f"model.{m.ours}" for m in maps} == set(shapes), "models/hf.py's map and the model disagree"


# ------------------------------------------------------------------------------------------------ import


class _LazySavePlanner(DefaultSavePlanner):
    """Saves meta-tensor placeholders: each tensor's data is made when the writer asks for it (one file
    per tensor, so the writer never holds two), then dropped."""

    def __init__(self, make, progress: tqdm):
        super().__init__()
        self.make, self.progress = make, progress

    def resolve_data(self, write_item):
        tensor = self.make(write_item.index.fqn)
        self.progress.update(1)
        return tensor


def import_hf(hf_dir: str | os.PathLike, out: str | os.PathLike, config_out: str | os.PathLike | None = None) -> Config:
    """Convert HF_DIR into a checkpoint at ``out`` (which must not exist); returns the training config
    written beside it (and to ``config_out``)."""
    hf_dir, out = Path(hf_dir).expanduser(), Path(out).expanduser().absolute()
    if out.exists():
        raise FileExistsError(f"{out}: already exists; choose another output (nothing is overwritten)")
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir}: no config.json (a Hugging Face model directory has one)")
    hf_config = json.loads((hf_dir / "config.json").read_text())
    fields = hf.model_fields_from_hf(hf_config)
    cfg = load_config(None, [f"model.{k}={json.dumps(v)}" for k, v in fields.items()]
                      + [f"train.init_from={json.dumps(str(out))}"])
    shards = HFShards(hf_dir)
    maps = hf.tensor_maps(cfg.model, hf_config["model_type"])
    wanted = {name for m in maps for name in m.hf}
    skipped = hf.zero_tensors(cfg.model, hf_config["model_type"])
    for name in sorted(shards.info):
        if name in skipped and (shards.meta(name).numel() == 0 or name.endswith("_gate.weight")):
            continue
        if name == "lm_head.weight" and cfg.model.share_embeddings_and_output_weights:
            continue  # tied: transformers uses the embedding, whatever the file holds
        if name not in wanted and not name.endswith(hf.DERIVED_SUFFIXES):
            raise HFConversionError(f"{hf_dir / shards.info[name][0]}: {name}: {hf.unmapped_tensor_hint(name)}")
    missing = sorted(wanted - set(shards.info))
    if missing:
        raise HFConversionError(f"{hf_dir}: {missing[0]} is missing, and {len(missing) - 1} more tensors that "
                                "config.json describes")
    placeholders, by_key = {}, {}
    for m in maps:
        key = f"model.{m.ours}"
        parts = [shards.meta(name) for name in m.hf]
        try:
            placeholders[key] = hf.to_ours(m, parts, cfg.model).to(parts[0].dtype)
        except RuntimeError as err:
            raise HFConversionError(f"{', '.join(m.hf)}: shapes {[list(p.shape) for p in parts]} do not fit "
                                    f"config.json ({err})") from None
        by_key[key] = m
    _check_keys(maps, model_logical_shapes(cfg.model), {k: t.shape for k, t in placeholders.items()},
                str(hf_dir))

    def make(key: str) -> torch.Tensor:
        m = by_key[key]
        return hf.to_ours(m, [shards.get(name) for name in m.hf], cfg.model).to(placeholders[key].dtype)

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted import
    with tqdm(total=len(maps), desc="import", unit="tensor", dynamic_ncols=True) as progress:
        with _single_process_quiet():
            dcp.save(placeholders, storage_writer=FileSystemWriter(str(tmp), single_file_per_rank=False),
                     planner=_LazySavePlanner(make, progress), no_dist=True)
    (tmp / HF_FILES).mkdir()
    for name in HF_SIDE_FILES:
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, tmp / HF_FILES / name)
    text = config_yaml(cfg)
    (tmp / CONFIG_FILE).write_text(text)
    os.replace(tmp, out)
    if config_out is not None:
        Path(config_out).expanduser().write_text(text)
    return cfg


# ------------------------------------------------------------------------------------------------ export


def _hf_base(step: Path, cfg: Config) -> Path | None:
    """The imported model's side files: in the checkpoint, or in the one the run started from."""
    candidates = [step / HF_FILES]
    if cfg.train.init_from:
        try:
            candidates.append(resolve_checkpoint(cfg.train.init_from)[0] / HF_FILES)
        except FileNotFoundError:
            pass
    return next((c for c in candidates if (c / "config.json").is_file()), None)


def export_hf(source: str | os.PathLike, hf_dir: str | os.PathLike, config: str | os.PathLike | None = None,
              arch: str | None = None, dtype: str | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write the model weights of checkpoint ``source`` as a Hugging Face directory ``hf_dir`` (which must
    not exist, or be empty). A step removed under us by a running job's rotation (keep_last) is retried
    from its newest checkpoint."""
    hf_dir = Path(hf_dir).expanduser()
    if hf_dir.exists() and (not hf_dir.is_dir() or any(hf_dir.iterdir())):
        raise FileExistsError(f"{hf_dir}: exists and is not empty; choose another output (nothing is overwritten)")
    if dtype is not None and dtype not in DTYPES:
        raise HFConversionError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    for attempt in (1, 2, 3):
        step, config_path = resolve_checkpoint(source)
        try:
            return _export_step(step, Path(config) if config else config_path, hf_dir, arch, dtype, max_shard_bytes)
        except Exception:
            if step.exists() or attempt == 3:
                raise
            log.warning("%s was removed while reading it (a running job's keep_last); exporting its newest", step)


def _export_step(step: Path, config_path: Path | None, hf_dir: Path, arch: str | None, dtype: str | None,
                 max_shard_bytes: int) -> Path:
    if config_path is None:
        raise FileNotFoundError(f"{step}: no {CONFIG_FILE} beside the checkpoint or in its run directory; pass "
                                "--config with the run's config")
    cfg = load_config(config_path)
    base_dir = _hf_base(step, cfg)
    base = json.loads((base_dir / "config.json").read_text()) if base_dir else None
    arch = arch or (base or {}).get("model_type") or hf.default_arch(cfg.model)
    hf.check_exportable(cfg.model, arch)
    maps = hf.tensor_maps(cfg.model, arch)
    metadata = checkpoint_metadata(step)
    stored = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    _check_keys(maps, model_logical_shapes(cfg.model), {k: v.size for k, v in stored.items()}, str(step))
    out_dtype = {m.ours: DTYPES[dtype] if dtype else stored[f"model.{m.ours}"].properties.dtype for m in maps}
    shards = _plan_shards(maps, stored, out_dtype, max_shard_bytes)
    tmp = hf_dir.with_name(hf_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted export
    tmp.mkdir(parents=True)
    weight_map, total = {}, 0
    with tqdm(total=len(maps), desc="export", unit="tensor", dynamic_ncols=True) as progress:
        for index, shard_maps in enumerate(shards):
            file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
            state = {f"model.{m.ours}": torch.empty(stored[f"model.{m.ours}"].size,
                                                    dtype=stored[f"model.{m.ours}"].properties.dtype)
                     for m in shard_maps}
            with _single_process_quiet():
                dcp.load(state, checkpoint_id=str(step), no_dist=True)
            tensors = {}
            for m in shard_maps:
                for name, tensor in zip(m.hf, hf.to_hf(m, state.pop(f"model.{m.ours}"), cfg.model)):
                    tensors[name] = tensor.to(out_dtype[m.ours], copy=True)  # own storage: safetensors asks
                    weight_map[name] = file
                    total += tensors[name].nbytes
                progress.update(1)
            if index == len(shards) - 1:
                for name, shape in hf.zero_tensors(cfg.model, arch).items():
                    tensors[name], weight_map[name] = torch.zeros(shape, dtype=out_dtype["embedding.weight"]), file
                    total += tensors[name].nbytes
            write_safetensors(tmp / file, tensors)
            del tensors, state
    (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    hf_config = hf.hf_config_from_model(cfg.model, arch, base, _DTYPE_NAMES[out_dtype["embedding.weight"]])
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    for name in HF_SIDE_FILES[1:] if base_dir else ():
        if (base_dir / name).is_file():
            shutil.copy2(base_dir / name, tmp / name)
    if hf_dir.exists():
        hf_dir.rmdir()  # empty, checked above
    os.replace(tmp, hf_dir)
    return hf_dir


def _plan_shards(maps: list[TensorMap], stored: dict, out_dtype: dict, max_shard_bytes: int) -> list[list[TensorMap]]:
    """Consecutive tensors in shards of at most ``max_shard_bytes`` (a larger tensor alone in its own)."""
    shards, size = [[]], 0
    for m in maps:
        nbytes = stored[f"model.{m.ours}"].size.numel() * out_dtype[m.ours].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(m)
        size += nbytes
    return shards


# ------------------------------------------------------------------------------------------ train.init_from


@torch.no_grad()
def load_model_weights(model: torch.nn.Module, path: str) -> Path:
    """Load ``model``'s parameters (and the buffers the checkpoint has) from checkpoint ``path`` by logical
    name; every rank calls it, each reading only its own experts and TP blocks. Returns the step directory."""
    try:
        step, _ = resolve_checkpoint(path)
    except FileNotFoundError as err:
        raise ConfigError("train.init_from", path, str(err)) from None
    stored = checkpoint_metadata(step).state_dict_metadata
    state: dict[str, torch.Tensor] = {}  # this rank's parameters: its experts, its TP blocks
    for name, param in model.named_parameters():
        flat = param.data.view(-1)
        for key, offset, shape in logical_parts(name, param):
            view = flat[offset:offset + shape.numel()].view(shape)
            state[f"model.{key}"] = tp_logical_tensor(view, tp_shard(param))
    expected = model_logical_shapes(model.cfg)  # every rank's
    for name, buffer in model.state_dict(keep_vars=True).items():
        if f"model.{name}" not in state and f"model.{name}" in stored:
            state[f"model.{name}"], expected[f"model.{name}"] = buffer, buffer.shape
    mismatch = next((f"{step} has no {key}" if key not in stored else
                     f"{key} is {list(stored[key].size)} in {step}, {list(shape)} in the model"
                     for key, shape in expected.items()
                     if key not in stored or tuple(stored[key].size) != tuple(shape)), None)
    extra = sorted(k for k in stored if k.startswith("model.") and k not in expected)
    if extra:
        mismatch = f"{step} holds {extra[0]}, which the model has not ({len(extra)} such tensors)"
    if mismatch:
        raise ConfigError("train.init_from", path, f"{mismatch}: does the model config match its {CONFIG_FILE}?")
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(step), no_dist=not dist.is_initialized())
    return step
