"""Load a Hugging Face checkpoint directory: ``config.json`` + safetensors (one file, or shards
listed in ``model.safetensors.index.json``). No pickle.

The model is built on the meta device, then every parameter is replaced by the checkpoint tensor
read straight onto the target device in the requested dtype, so weights are materialised once.
Names go through the model's ``weight_rules`` (``dllm.models.weights``); a projection that the
model packs with others (q/k/v, gate/up: ``packed_modules``) is copied into its rows of the packed
parameter. A missing, unexpected or wrongly shaped tensor raises ``WeightLoadError`` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dllm.models.config import ModelConfig
from dllm.models.layers import PackedLinear
from dllm.models.registry import ArchitectureSpec, get_architecture
from dllm.models.weights import WeightRule, WeightTarget, resolve_weight

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class WeightLoadError(ValueError):
    """The checkpoint's tensors do not fit the model."""


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in a fixed order."""
    index = path / INDEX_FILE
    if index.exists():
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{index} lists missing shards: {missing}")
        return files
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    others = sorted(path.glob("*.safetensors"))
    if others:
        return others
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise FileNotFoundError(f"{path}: only pickle checkpoints found; safetensors are required")
    raise FileNotFoundError(f"{path}: no safetensors checkpoint")


def iter_checkpoint(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def _expected_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers: what the checkpoint must provide."""
    expected = dict(model.named_parameters())
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                expected[f"{module_name}.{name}" if module_name else name] = buf
    return expected


def _fp32_names(model: nn.Module) -> set[str]:
    """Tensors a module asks to keep in float32 (``fp32_params``), e.g. router weights."""
    names: set[str] = set()
    for module_name, module in model.named_modules():
        for leaf in getattr(module, "fp32_params", ()):
            names.add(f"{module_name}.{leaf}" if module_name else leaf)
    return names


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


class _Assembler:
    """Collects checkpoint tensors into the model's parameters, checking names and shapes."""

    def __init__(self, model: nn.Module, rules: tuple[WeightRule, ...], dtype: torch.dtype,
                 device: torch.device):
        self.model = model
        self.rules = rules
        self.dtype = dtype
        self.device = device
        self.expected = _expected_tensors(model)
        self.fp32 = _fp32_names(model)
        self.done: set[str] = set()
        # Stacked (per-expert) and packed (q/k/v, gate/up) parameters, filled part by part.
        self.stacks: dict[str, tuple[torch.Tensor, list[bool]]] = {}
        self.parts: dict[str, list[str]] = {}
        self.unexpected: list[str] = []

    def _dtype_for(self, name: str, source: torch.Tensor) -> torch.dtype:
        if not source.is_floating_point():
            return source.dtype
        return torch.float32 if name in self.fp32 else self.dtype

    def add(self, ckpt_name: str, tensor: torch.Tensor) -> None:
        target = resolve_weight(self.rules, ckpt_name)
        if target is None:
            return
        if target.name not in self.expected:
            packed = self._packed_target(target.name)
            if packed is None:
                self.unexpected.append(ckpt_name)
                return
            self._add_shard(ckpt_name, *packed, tensor)
        elif target.index is None:
            self._add_plain(ckpt_name, target, tensor)
        else:
            self._add_stacked(ckpt_name, target, tensor)

    def _packed_target(self, name: str) -> tuple[str, PackedLinear, int, list[str]] | None:
        """``parent.q_proj.weight`` → (``parent.qkv_proj.weight``, the packed module, shard
        index, the unpacked names of every shard) where ``parent`` packs ``q_proj`` (its
        ``packed_modules``)."""
        parent, _, rest = name.rpartition(".")
        parent, _, sub = parent.rpartition(".")
        try:
            module = self.model.get_submodule(parent)
        except AttributeError:
            return None
        packed_name, index = getattr(module, "packed_modules", {}).get(sub, (None, 0))
        full = f"{parent}.{packed_name}.{rest}" if parent else f"{packed_name}.{rest}"
        if packed_name is None or full not in self.expected:
            return None
        shards = sorted((i, f"{parent}.{sub}.{rest}".lstrip("."))
                        for sub, (target, i) in module.packed_modules.items()
                        if target == packed_name)
        return full, module.get_submodule(packed_name), index, [n for _, n in shards]

    def _localize(self, name: str, tensor: torch.Tensor, shard: int | None = None
                  ) -> torch.Tensor:
        """This tensor-parallel rank's part of a checkpoint tensor: the owning module's
        ``localize`` where it has one (split projections, the vocabulary), else all of it."""
        module_name, _, leaf = name.rpartition(".")
        localize = getattr(self.model.get_submodule(module_name), "localize", None)
        return tensor if localize is None else localize(leaf, tensor, shard)

    def _add_plain(self, ckpt_name: str, target: WeightTarget, tensor: torch.Tensor) -> None:
        tensor = self._localize(target.name, tensor)
        want = tuple(self.expected[target.name].shape)
        if tuple(tensor.shape) != want:
            raise WeightLoadError(
                f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, but parameter "
                f"{target.name!r} expects {want}")
        if target.name in self.done or target.name in self.stacks:
            raise WeightLoadError(f"checkpoint tensor {ckpt_name!r} sets {target.name!r} twice")
        value = tensor.to(device=self.device, dtype=self._dtype_for(target.name, tensor))
        _set_tensor(self.model, target.name, value)
        self.done.add(target.name)

    def _slot(self, name: str, parts: list[str], tensor: torch.Tensor,
              ckpt_name: str) -> tuple[torch.Tensor, list[bool]]:
        """The buffer that collects the parts of ``name`` (a stacked or packed parameter)."""
        if name in self.done:
            raise WeightLoadError(f"checkpoint tensor {ckpt_name!r} sets {name!r} twice")
        if name not in self.stacks:
            buf = torch.empty(tuple(self.expected[name].shape),
                              dtype=self._dtype_for(name, tensor), device=self.device)
            self.stacks[name] = (buf, [False] * len(parts))
            self.parts[name] = parts
        return self.stacks[name]

    def _add_stacked(self, ckpt_name: str, target: WeightTarget, tensor: torch.Tensor) -> None:
        module_name = target.name.rpartition(".")[0]
        local_index = getattr(self.model.get_submodule(module_name), "local_index", None)
        index = target.index if local_index is None else local_index(target.index)
        if index is None:  # an expert another expert-parallel rank holds
            return
        tensor = self._localize(target.name, tensor)
        want = tuple(self.expected[target.name].shape)
        if not 0 <= index < want[0] or tuple(tensor.shape) != want[1:]:
            raise WeightLoadError(
                f"checkpoint tensor {ckpt_name!r} (shape {tuple(tensor.shape)}) does not fit "
                f"slice [{index}] of parameter {target.name!r} of shape {want}")
        parts = [f"{target.name}[{i}]" for i in range(want[0])]
        buf, filled = self._slot(target.name, parts, tensor, ckpt_name)
        if filled[index]:
            raise WeightLoadError(
                f"checkpoint tensor {ckpt_name!r} sets {target.name}[{index}] twice")
        buf[index].copy_(tensor)
        filled[index] = True

    def _add_shard(self, ckpt_name: str, name: str, packed: PackedLinear, index: int,
                   parts: list[str], tensor: torch.Tensor) -> None:
        tensor = self._localize(name, tensor, index)
        rows = packed.shard_rows(index)
        want = (rows.stop - rows.start, *self.expected[name].shape[1:])
        if tuple(tensor.shape) != want:
            raise WeightLoadError(
                f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, but its "
                f"rows of parameter {name!r} ({parts[index]}) expect {want}")
        buf, filled = self._slot(name, parts, tensor, ckpt_name)
        if filled[index]:
            raise WeightLoadError(f"checkpoint tensor {ckpt_name!r} sets {parts[index]} twice")
        buf[rows].copy_(tensor)
        filled[index] = True

    def finish(self) -> None:
        if self.unexpected:
            raise WeightLoadError(
                f"unexpected checkpoint tensors (no parameter of {type(self.model).__name__} "
                f"takes them): {self.unexpected[:20]}"
                + (f" and {len(self.unexpected) - 20} more" if len(self.unexpected) > 20 else ""))
        missing: list[str] = []
        for name, (buf, filled) in self.stacks.items():
            missing += [part for part, ok in zip(self.parts[name], filled, strict=True) if not ok]
            _set_tensor(self.model, name, buf)
            self.done.add(name)
        missing += sorted(set(self.expected) - self.done)
        if missing:
            raise WeightLoadError(f"checkpoint lacks tensors for parameters: {missing[:20]}"
                                  + (f" and {len(missing) - 20} more" if len(missing) > 20 else ""))


def load_weights(model: nn.Module, path: str | Path, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> nn.Module:
    """Fill ``model`` (built on any device, typically meta) from the safetensors in ``path``."""
    path, device = Path(path), torch.device(device)
    assembler = _Assembler(model, tuple(getattr(model, "weight_rules", ())), dtype, device)
    for name, tensor in iter_checkpoint(checkpoint_files(path), device):
        assembler.add(name, tensor)
    assembler.finish()
    for module in model.modules():
        init = getattr(module, "init_buffers", None)
        if init is not None:
            init(device)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise WeightLoadError(f"tensors left uninitialised after loading: {still_meta}")
    return model.eval()


_DTYPE_NAMES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "half": torch.float16}


def resolve_dtype(config: ModelConfig, dtype: torch.dtype | str) -> torch.dtype:
    """``dtype`` itself, or for ``"auto"`` the config's ``torch_dtype`` (newer: ``dtype``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype
    if dtype == "auto":
        name = config.get("torch_dtype") or config.get("dtype") or "float32"
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(_DTYPE_NAMES)} or 'auto'")
    return _DTYPE_NAMES[name]


LOAD_FORMATS = ("safetensors", "dummy")


def load_model(
    path: str | Path, dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
    load_format: str = "safetensors", seed: int = 0,
) -> tuple[nn.Module, ArchitectureSpec, ModelConfig]:
    """Build the model of the checkpoint at ``path`` (dispatch on ``architectures[0]``) and load
    its weights, cast to ``dtype`` (a torch dtype, its name, or ``"auto"`` for the config's
    ``torch_dtype``), onto ``device``. ``load_format="dummy"`` reads only ``config.json`` and
    fills the weights with seeded random values on ``device`` (benchmarks of real shapes
    without real weights, like vLLM's ``--load-format dummy``)."""
    path = Path(path)
    config = ModelConfig.from_file(path / "config.json")
    spec = get_architecture(config.architecture)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if load_format == "dummy":
        with torch.device(device):
            model = spec.model_cls(config)
        init_dummy_weights(model, resolve_dtype(config, dtype), seed)
        return model, spec, config
    with torch.device("meta"):
        model = spec.model_cls(config)
    load_weights(model, path, resolve_dtype(config, dtype), device)
    return model, spec, config


@torch.no_grad()
def init_dummy_weights(model: nn.Module, dtype: torch.dtype, seed: int = 0) -> None:
    """Matrices ~ N(0, 0.02), norm weights 1, biases 0; float32-kept tensors stay float32."""
    keep_fp32 = _fp32_names(model)
    gen = None
    for name, p in model.named_parameters():
        if gen is None or gen.device != p.device:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        if p.dim() >= 2:
            p.normal_(0.0, 0.02, generator=gen)
        elif "norm" in name:
            p.fill_(1.0)
        else:
            p.zero_()
        if name not in keep_fp32:
            p.data = p.data.to(dtype)
    for p in model.parameters():
        p.requires_grad_(False)
