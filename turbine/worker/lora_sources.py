"""Where a LoRA adapter comes from: a source URI -> a local folder the engine reads.

- a path (absolute, or relative to the worker's working directory) or `file:///path`: used in
  place, not copied. vLLM reads the folder at load, and again if it evicted the adapter from its
  CPU cache (`--max-cpu-loras`), so the folder must stay while the adapter is loaded.
- `hf://owner/repo[@revision]`: downloaded from the Hugging Face hub (huggingface_hub) into the
  cache directory, `$TURBINE_LORA_CACHE` (default `$TURBINE_CACHE/loras`, i.e.
  `~/.cache/turbine/loras`), under `hf/owner--repo[--revision]`; a later load finds it there
  without the hub. An unreachable hub is a clear error.
- anything else (`s3://` included: there is no S3-compatible server here to test against) is
  refused with an error naming the schemes served.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from turbine.worker.lora_check import AdapterError

LORA_CACHE_ENV = "TURBINE_LORA_CACHE"
SCHEMES = ("a local path", "file://", "hf://")


def lora_cache_dir() -> Path:
    explicit = os.environ.get(LORA_CACHE_ENV)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("TURBINE_CACHE") or Path.home() / ".cache" / "turbine") / "loras"


def resolve_source(uri: str, cache_dir: Path | None = None) -> str:
    """The local folder of the adapter at `uri` (downloading it first for hf://), or AdapterError.
    Blocking: call it off the event loop."""
    if not uri:
        raise AdapterError("source.uri is empty")
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower() if len(parsed.scheme) > 1 else ""  # "C:" is no scheme
    if scheme == "":
        return str(Path(uri).expanduser().resolve())
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise AdapterError(f"{uri}: a file:// URI names a path on this host (file:///path)")
        return str(Path(unquote(parsed.path)).resolve())
    if scheme == "hf":
        return _hf(uri, parsed.netloc + parsed.path, cache_dir or lora_cache_dir())
    if scheme == "s3":
        raise AdapterError(f"{uri}: s3:// sources are not supported (not built: no S3-compatible server to test "
                           f"against); copy the adapter to a local folder and give its path")
    raise AdapterError(f"{uri}: unsupported source scheme {scheme!r}; use {', '.join(SCHEMES)}")


def _hf(uri: str, spec: str, cache_dir: Path) -> str:
    repo, _, revision = spec.strip("/").partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise AdapterError(f"{uri}: expected hf://owner/repo or hf://owner/repo@revision")
    target = cache_dir / "hf" / "--".join([*repo.split("/"), *([revision] if revision else [])])
    if (target / "adapter_config.json").is_file():
        return str(target)  # downloaded before
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise AdapterError(f"{uri}: hf:// needs the huggingface_hub package") from None
    try:
        snapshot_download(repo_id=repo, revision=revision or None, local_dir=str(target),
                          allow_patterns=["adapter_config.json", "adapter_model.safetensors"], etag_timeout=10)
    except Exception as exc:  # no hub reachable, no such repo, no access: all the loader's to hear
        raise AdapterError(f"{uri}: could not download from the Hugging Face hub "
                           f"({type(exc).__name__}: {_first_line(exc)})") from None
    return str(target)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "no detail"
