"""Loading what a recipe names: where its model name points, the tokenizer, a check of the model's files
before any of them is loaded, and the user's own code by import path (rewards, algorithms). Training and
evaluation both load through here."""

from __future__ import annotations

import difflib
import importlib
import json
import logging
import os
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import constants
from safetensors import safe_open

logger = logging.getLogger(__name__)


class RecipeError(ValueError):
    """A recipe, an override or a model path the user must fix; the message says how."""

# Recipes name the bundled assets (poise_trl/data/, shipped as package data) as `data/...`.
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_DATA = PACKAGE_ROOT / "data"


def resolve_model_path(model: str) -> str:
    """Recipes name bundled files relative to the package (`data/tiny-qwen3`, `recipes/accelerate/ddp.yaml`);
    anything else is a local path or a hub id handed to transformers as is."""
    if not Path(model).exists() and (PACKAGE_ROOT / model).exists():
        return str(PACKAGE_ROOT / model)
    return model


def import_from_path(path: str, what: str):
    """`package.module:attribute` from an installed package, or from the working directory (put first on the
    import path, as `python -m` puts it, when nothing else has the module); `what` names it in the error."""
    module_name, _, attribute = path.partition(":")
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if os.getcwd() in sys.path or exc.name != module_name.partition(".")[0]:
                raise
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
        return getattr(module, attribute)
    except ImportError as exc:
        raise RecipeError(f"{what} {path!r}: cannot import {module_name!r} ({exc}) from the working directory or "
                          "the installed packages; put its package on PYTHONPATH or install it") from None
    except AttributeError:
        raise RecipeError(f"{what} {path!r}: module {module_name!r} has no {attribute!r}") from None


def import_callable(path: str, what: str):
    """`import_from_path`, for a function or class the run calls (a reward function, tool, environment)."""
    found = import_from_path(path, what)
    if not callable(found):
        raise RecipeError(f"{what} {path!r} is not callable")
    return found


def hub_unreachable(timeout: float = 1.0) -> str | None:
    """Why the Hub cannot be reached from here, or None. One TCP connect of at most `timeout`
    seconds, instead of the 25-55 s of retries `datasets` spends before failing offline."""
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
    except OSError as exc:
        return f"{host} is unreachable: {exc.strerror or exc.__class__.__name__}"
    return None


def offline_if_hub_unreachable() -> None:
    """Without network and without HF_HUB_OFFLINE: go on as HF_HUB_OFFLINE=1 would (hub models and datasets
    from the local cache, at once) instead of the retries `datasets` and transformers spend before failing,
    and say so in one line."""
    if constants.HF_HUB_OFFLINE or not (reason := hub_unreachable()):
        return
    os.environ["HF_HUB_OFFLINE"] = "1"  # for libraries not imported yet
    constants.HF_HUB_OFFLINE = True  # huggingface_hub and transformers read it at every call
    if (datasets_config := sys.modules.get("datasets.config")) is not None:
        datasets_config.HF_HUB_OFFLINE = True  # `datasets` reads it once, at its import
    logger.warning(f"note: {reason}: going on offline, with hub models and datasets from the local cache "
                   "(HF_HUB_OFFLINE=1 says so up front)")


def load_tokenizer(model: str):
    from transformers import AutoTokenizer  # noqa: PLC0415 (`poise --help` imports this module)

    check_model_files(model)
    bundled = [f"data/{folder.name}" for folder in BUNDLED_DATA.iterdir() if (folder / "config.json").is_file()]
    if not Path(model).exists() and (close := difflib.get_close_matches(model, bundled, n=1, cutoff=0.8)):
        # a local name first, then the hub (which offline would answer with a network error)
        raise RecipeError(f"model {model!r} is no local folder; did you mean the bundled {close[0]!r}?")
    if not Path(model).exists():
        offline_if_hub_unreachable()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except OSError as exc:
        raise RecipeError(
            f"cannot load a tokenizer from {model!r}: {exc.__class__.__name__}. Give a local model folder or a hub id "
            "(offline runs need the model in the local cache; the bundled tiny model is data/tiny-qwen3)"
        ) from None
    require_chat_template(tokenizer, f"model {model!r}")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_causal_lm(model: str):
    """The policy for evaluation (bf16 on a GPU, float32 on a CPU), on the GPU when there is one."""
    import torch  # noqa: PLC0415 (`poise --help` imports this module)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (`poise --help` imports this module)

    check_model_files(model)
    cuda = torch.cuda.is_available()
    try:
        with quiet_transformers():
            loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16 if cuda else torch.float32)
    except OSError as exc:
        raise RecipeError(f"cannot load the model {model!r}: {exc.__class__.__name__}: {exc}") from None
    return loaded.to("cuda" if cuda else "cpu")


@contextmanager
def quiet_transformers():
    """transformers' load reports and progress bars off: the tools show their own progress, and a new
    value head is missing from a checkpoint by design."""
    from transformers.utils import logging as hf_logging  # noqa: PLC0415 (`poise --help` imports this module)

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def require_chat_template(tokenizer, model_name: str = "the model") -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{model_name} has no chat template, but poise-trl feeds conversational prompts. "
                         "Use an instruct/chat checkpoint or set `tokenizer.chat_template` and save the tokenizer.")


MODEL_JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "adapter_config.json")


def check_model_files(folder: str | Path) -> None:
    """A truncated or corrupt weights, config or tokenizer file in a local model folder (or a
    checkpoint) gives one line naming it, before any of it is loaded. Reads only the
    safetensors headers and the small JSON files, so it costs milliseconds on a 4B model."""
    folder = Path(folder)
    if not folder.is_dir():
        return  # a hub id: transformers resolves and checks it
    for name in MODEL_JSON_FILES:
        path = folder / name
        if path.is_file():
            try:
                json.loads(path.read_text())
            except (ValueError, UnicodeDecodeError):
                raise RecipeError(f"{path} is not valid JSON (truncated or corrupt): restore or rebuild that "
                                  "file") from None
    weights = sorted(folder.glob("*.safetensors"))
    if not weights and not any(folder.glob("*.bin")) and (folder / "config.json").is_file():
        raise RecipeError(f"model folder {folder} has a config.json but no weights (*.safetensors): copy the weights "
                          "into it, or give another model")
    for path in weights:
        try:
            with safe_open(str(path), "pt") as handle:
                handle.keys()
        except Exception as exc:  # safetensors raises its own error type for every kind of damage
            raise RecipeError(f"{path} is truncated or corrupt ({exc}): restore or rebuild that file") from None
