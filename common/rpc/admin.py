"""Worker admin helpers behind the gRPC API: tokenizer bundle for GetTokenizer, and the torch profiler."""

from __future__ import annotations

import hashlib
import io
import os
import threading
import time
import zipfile
from typing import Optional

# Files a remote tokenizer needs (HF layout); whichever of them the model dir has go into the bundle.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "config.json", "chat_template.jinja", "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt",
    "tokenizer.model",
)
CHUNK_BYTES = 1 << 20
DEFAULT_PROFILE_DIR = os.environ.get("TANDEM_PROFILE_DIR", "/tmp/tandem-profiles")


def profile_output_dir(root: str, output_dir: Optional[str]) -> str:
    """Where a trace may go: `output_dir` (relative ones under `root`) once symlinks and `..` are resolved, which
    must be `root` or below it; ValueError naming the allowed root otherwise (a caller must not make the worker
    write anywhere it can)."""
    real_root = os.path.realpath(root)
    target = os.path.realpath(os.path.join(real_root, output_dir)) if output_dir else real_root
    if target != real_root and not target.startswith(real_root.rstrip(os.sep) + os.sep):
        raise ValueError(f"output_dir {output_dir!r} is outside the profile directory {real_root}; pass a "
                         f"directory under it (or start the worker with another --profile-dir)")
    return target


def tokenizer_bundle(model_dir: str) -> tuple[bytes, str]:
    """Zip the tokenizer files at the archive root (deterministic timestamps); returns (bytes, sha256 hex)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in TOKENIZER_FILES:
            path = os.path.join(model_dir, name)
            if os.path.isfile(path):
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                with open(path, "rb") as f:
                    zf.writestr(info, f.read())
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def chunks(data: bytes, size: int = CHUNK_BYTES) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)] or [b""]


class Profiler:
    """torch.profiler started and stopped on the scheduler thread, exported as a Chrome trace under `root`."""

    def __init__(self, engine, root: str = DEFAULT_PROFILE_DIR):
        self.engine = engine
        self.root = root
        self._lock = threading.Lock()
        self._profile = None
        self._output_dir: Optional[str] = None

    def start(self, output_dir: Optional[str], with_stack: bool = False, record_shapes: bool = False,
              activities: tuple[str, ...] = ()) -> str:
        import torch.profiler as tp  # torch: a --dp-size N controller imports this module and never loads it

        with self._lock:
            if self._profile is not None:
                raise RuntimeError("the profiler is already running; call StopProfile first")
            output_dir = profile_output_dir(self.root, output_dir)
            kinds = {a.upper() for a in activities} or {"CPU", "GPU"}
            acts = [tp.ProfilerActivity.CPU] if "CPU" in kinds else []
            if "GPU" in kinds and self.engine.device.type == "cuda":
                acts.append(tp.ProfilerActivity.CUDA)
            if not acts:
                raise ValueError(f"no supported profiler activity in {sorted(kinds)}; use CPU or GPU")
            os.makedirs(output_dir, exist_ok=True)
            profile = tp.profile(activities=acts, with_stack=with_stack, record_shapes=record_shapes,
                                 profile_memory="MEM" in kinds)
            self.engine.call(lambda s: profile.start())  # the scheduler thread runs the forward passes
            self._profile, self._output_dir = profile, output_dir
            return output_dir

    def stop(self) -> str:
        with self._lock:
            if self._profile is None:
                raise RuntimeError("the profiler is not running; call StartProfile first")
            profile, self._profile = self._profile, None
            self.engine.call(lambda s: profile.stop())
            path = os.path.join(self._output_dir, f"tandem-{int(time.time() * 1000)}-{os.getpid()}.trace.json")
            profile.export_chrome_trace(path)
            return path
