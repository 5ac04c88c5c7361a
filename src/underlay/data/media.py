"""Images and videos for vision-language data: read from local files, bytes or any URL that
:func:`underlay.data.files.copy_to_local` reads, and videos sampled to frames.

Sources (one image or one video each):

- a path (``str`` / ``Path``, ``file://`` included) or a remote URL (``s3://``, ``gs://``, ``hf://``,
  ``memory://``, ... through fsspec; copied once into the cache);
- ``bytes`` of an encoded file (PNG, JPEG, ... for images; a container for videos);
- a mapping ``{"bytes": ...}`` or ``{"path": ...}`` (the layout of ``datasets``' ``Image``/``Video``
  features);
- an already decoded image (``PIL.Image.Image``, or an ``[H, W, 3]`` uint8 array);
- for a video, also a list of image sources: its frames.

Images need Pillow (the ``vision`` extra); video files need PyAV (``av``) or OpenCV (``cv2``):
``ConfigError`` naming the package when it is missing. An unreadable source is ``InvalidInput``
naming it.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from underlay.interfaces import ConfigError, InvalidInput

__all__ = ["VideoFrames", "load_image", "load_video", "sample_frame_indices"]


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError as exc:
        raise ConfigError(
            "images need Pillow, which is not installed; pip install 'underlay[vision]' (or pillow)"
        ) from exc
    return Image


def _describe(src: Any) -> str:
    if isinstance(src, (bytes, bytearray)):
        return f"<{len(src)} bytes>"
    if isinstance(src, Mapping):
        return f"<mapping with keys {sorted(src)}>"
    return repr(src)[:120]


def _read_bytes(src: Any, cache_dir: str | Path | None) -> bytes | Path:
    """``bytes`` of an encoded source, or the local path holding it."""
    from underlay.data.files import copy_to_local

    if isinstance(src, Mapping):
        if src.get("bytes") is not None:
            return bytes(src["bytes"])
        if src.get("path") is not None:
            return _read_bytes(src["path"], cache_dir)
        raise InvalidInput(f"media source {_describe(src)}: give 'bytes' or 'path'")
    if isinstance(src, (bytes, bytearray)):
        return bytes(src)
    if isinstance(src, (str, Path)):
        return copy_to_local(str(src), cache_dir=cache_dir)
    raise InvalidInput(
        f"media source {_describe(src)} of type {type(src).__name__}: give a path, a URL, bytes, "
        "{'bytes': ...} / {'path': ...}, or a decoded image"
    )


def load_image(src: Any, *, cache_dir: str | Path | None = None) -> Any:
    """The image ``src`` (see the module doc for the accepted sources) as an RGB ``PIL.Image``.

    Raises ``ConfigError`` when Pillow is missing, ``InvalidInput`` naming the source when it cannot
    be read or decoded."""
    image_mod = _pil()
    if isinstance(src, image_mod.Image):
        return src.convert("RGB")
    if isinstance(src, np.ndarray):
        if src.ndim != 3 or src.shape[-1] != 3 or src.dtype != np.uint8:
            raise InvalidInput(f"image array of shape {src.shape} {src.dtype}: give [H, W, 3] uint8")
        return image_mod.fromarray(src, mode="RGB")
    data = _read_bytes(src, cache_dir)
    try:
        with image_mod.open(io.BytesIO(data) if isinstance(data, bytes) else data) as im:
            return im.convert("RGB")
    except (OSError, ValueError) as exc:  # PIL.UnidentifiedImageError is an OSError
        raise InvalidInput(f"image {_describe(src)} could not be decoded: {exc}") from exc


@dataclass(frozen=True)
class VideoFrames:
    """Sampled frames of one video: ``frames`` ``[T, H, W, 3]`` uint8 (RGB) and ``fps``, the rate of
    the sampled frames (frames per second of the video's time line)."""

    frames: np.ndarray[Any, Any]
    fps: float


def sample_frame_indices(
    total: int, source_fps: float, *, fps: float, min_frames: int, max_frames: int, multiple: int = 1
) -> list[int]:
    """Indices of the frames to keep from a video of ``total`` frames at ``source_fps``: ``fps`` frames
    per second of video, clamped to ``[min_frames, max_frames]`` and to ``total``, rounded down to a
    multiple of ``multiple`` (the model's temporal patch) but at least ``multiple``; spread evenly over
    the video, first and last frame included. Raises ``InvalidInput`` for a video with no frames and
    ``ConfigError`` for inconsistent limits."""
    if total < 1:
        raise InvalidInput("the video has no frames")
    if not (fps > 0 and math.isfinite(fps)) or min_frames < 1 or max_frames < min_frames or multiple < 1:
        raise ConfigError(
            f"video sampling fps={fps}, min_frames={min_frames}, max_frames={max_frames}, "
            f"multiple={multiple}: need fps > 0 and 1 <= min_frames <= max_frames"
        )
    duration = total / source_fps if source_fps > 0 else total / fps
    n = min(max(round(duration * fps), min_frames), max_frames, total)
    n = max(multiple, n - n % multiple)
    if n == 1:
        return [0]
    return [round(i * (total - 1) / (n - 1)) for i in range(n)]


def _decode_video_file(path: Path | bytes) -> tuple[list[np.ndarray[Any, Any]], float]:
    """All frames of a video file (RGB uint8) and its frame rate, through PyAV or OpenCV."""
    try:
        import av
    except ImportError:
        av = None
    if av is not None:
        with av.open(io.BytesIO(path) if isinstance(path, bytes) else str(path)) as container:
            stream = container.streams.video[0]
            rate = float(stream.average_rate or 0.0)
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return frames, rate
    try:
        import cv2
    except ImportError as exc:
        raise ConfigError(
            "video files need PyAV (pip install av) or OpenCV (pip install opencv-python-headless), "
            "neither is installed; or pass the video as a list of frame images"
        ) from exc
    if isinstance(path, bytes):
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".video") as tmp:
            tmp.write(path)
            tmp.flush()
            return _decode_video_file(Path(tmp.name))
    cap = cv2.VideoCapture(str(path))
    rate = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
    frames = []
    while True:
        ok, frame = cap.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    cap.release()
    return frames, rate


def load_video(
    src: Any,
    *,
    fps: float = 2.0,
    min_frames: int = 2,
    max_frames: int = 64,
    multiple: int = 2,
    source_fps: float | None = None,
    cache_dir: str | Path | None = None,
) -> VideoFrames:
    """The video ``src`` sampled to frames (:func:`sample_frame_indices`): a file source (path, URL,
    bytes, ``{"bytes"|"path": ...}``) is decoded with PyAV or OpenCV at its own frame rate; a list of
    image sources is taken as frames at ``source_fps`` (default: ``fps``, every frame a sample). Frames
    must share one size. Raises ``ConfigError`` for a missing decoder package, ``InvalidInput`` naming
    the source when it cannot be read, has no frames, or its frames differ in size."""
    if isinstance(src, Sequence) and not isinstance(src, (str, bytes, bytearray)):
        images = [np.asarray(load_image(f, cache_dir=cache_dir)) for f in src]
        rate = float(source_fps if source_fps is not None else fps)
    else:
        data = _read_bytes(src, cache_dir)
        try:
            images, rate = _decode_video_file(data)
        except (OSError, ValueError, RuntimeError) as exc:
            raise InvalidInput(f"video {_describe(src)} could not be decoded: {exc}") from exc
        if source_fps is not None:
            rate = float(source_fps)
    if not images:
        raise InvalidInput(f"video {_describe(src)} has no frames")
    shapes = {im.shape for im in images}
    if len(shapes) != 1:
        raise InvalidInput(f"video {_describe(src)}: frames differ in size {sorted(shapes)}")
    idx = sample_frame_indices(
        len(images), rate, fps=fps, min_frames=min_frames, max_frames=max_frames, multiple=multiple
    )
    duration = len(images) / rate if rate > 0 else len(idx) / fps
    return VideoFrames(np.stack([images[i] for i in idx]), len(idx) / duration)
