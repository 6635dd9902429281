"""Load a checkpoint (config.json + *.safetensors + tokenizer files) through mlx-lm."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.models.errors import ModelError
from mlxcel.models.identity import layer_count, read_config

# Never reach a model hub: a checkpoint is a local directory or nothing.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@dataclass
class LoadedModel:
    """A model, its tokenizer (mlx-lm TokenizerWrapper; None when loaded without) and where they came from."""

    model: Any
    tokenizer: Any
    config: dict
    path: Path

    @property
    def num_layers(self) -> int:
        return layer_count(self.config)

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type"))

    @property
    def name(self) -> str:
        return self.path.name

    def sampling_defaults(self) -> dict[str, float | int]:
        """temperature / top_p / top_k from generation_config.json, for requests that name none."""
        return read_sampling_defaults(self.path)

    def describe_weights(self) -> str:
        """Human summary of the weight representation, e.g. 'float32' or '4-bit (group 32), embedding 8-bit'."""
        quant = self.config.get("quantization")
        if not quant:
            return str(self.config.get("torch_dtype") or self.config.get("dtype") or "float32")
        text = f"{quant.get('bits')}-bit (group {quant.get('group_size')})"
        overrides = {k: v for k, v in quant.items() if isinstance(v, dict)}
        for module, spec in overrides.items():
            short = module.rsplit(".", 1)[-1].replace("embed_tokens", "embedding")
            text += f", {short} {spec.get('bits')}-bit"
        return text


SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def read_sampling_defaults(model_dir: Path) -> dict[str, float | int]:
    """The sampling values a checkpoint's generation_config.json recommends (may be empty)."""
    try:
        config = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    return {k: config[k] for k in SAMPLING_KEYS if isinstance(config.get(k), (int, float)) and not isinstance(config.get(k), bool)}


def _family_module_exists(model_type: str) -> bool:
    """mlx-lm ships ``mlx_lm/models/<model_type>.py`` (found without importing mlx-lm, which takes seconds)."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations or not model_type.isidentifier():
        return False
    return any((Path(root) / "models" / f"{model_type}.py").is_file() for root in spec.submodule_search_locations)


def check_checkpoint(model_dir: str | Path) -> dict:
    """Validate that a directory looks like a supported checkpoint; return its config."""
    path = Path(model_dir)
    if not path.exists():
        raise ModelError(f"{path}: no such model directory")
    if not path.is_dir():
        raise ModelError(f"{path}: not a directory (a checkpoint is a directory with config.json)")
    _, config = read_config(path)
    if not list(path.glob("*.safetensors")):
        raise ModelError(f"{path}: not a checkpoint (no *.safetensors files)")
    model_type = config.get("model_type")
    if not model_type:
        raise ModelError(f"{path}/config.json: no model_type")
    if not _family_module_exists(str(model_type)):
        from mlx_lm.utils import _get_classes  # mlx-lm resolves families and their aliases

        try:
            _get_classes(config)
        except (ValueError, ImportError):
            raise ModelError(f"{path}: unknown architecture {model_type!r} (not a model family mlx-lm provides)") from None
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise ModelError(f"{path}: no tokenizer files (tokenizer.json or tokenizer.model)")
    return config


def load_checkpoint(model_dir: str | Path, *, lazy: bool = False, tokenizer: bool = True) -> LoadedModel:
    """Load model and tokenizer; every failure becomes one ModelError line.

    ``tokenizer=False`` loads the model alone (``LoadedModel.tokenizer`` is None): for a node that never sees text
    (a pipeline stage, which gets token ids or hidden states; a tensor-parallel follower). Building mlx-lm's tokenizer costs about 0.8 s of
    CPU per process here.
    """
    path = Path(model_dir)
    check_checkpoint(path)
    mlx_lm = importlib.import_module("mlx_lm.utils")
    try:
        if tokenizer:
            model, wrapper, config = mlx_lm.load(str(path), lazy=lazy, return_config=True)
        else:
            (model, config), wrapper = mlx_lm.load_model(path, lazy), None
    except (ValueError, FileNotFoundError, KeyError, OSError) as exc:
        raise ModelError(f"{path}: cannot load checkpoint: {exc}") from None
    _eval_private_arrays(model)
    from mlxcel.models import vocab_source  # where a grammar finds this model's vocabulary (read once one comes)

    vocab_source.register(wrapper or path, config.get("vocab_size"))
    return LoadedModel(model=model, tokenizer=wrapper, config=config, path=path)


def _eval_private_arrays(model: Any) -> None:
    """Evaluate the arrays a model keeps outside its parameters (``_``-prefixed: rope frequencies, ...).

    mlx-lm's ``load`` evaluates the parameters only; a family that builds, say, ``rope._freqs`` at
    construction leaves it a lazy array of the loading thread's stream, and the scheduler's thread,
    which has no such stream, then fails ("There is no Stream(cpu, 0) in current thread"). They are
    computed, never read from the checkpoint, so this reads no weight even for a lazy load.
    """
    import mlx.core as mx

    private = [v for _, module in model.named_modules() for k, v in module.items()
               if k.startswith("_") and isinstance(v, mx.array)]
    if private:
        mx.eval(private)
