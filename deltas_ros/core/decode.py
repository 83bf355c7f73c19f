"""Camera messages to RGB frames, without ROS: decode_raw / decode_compressed turn the fields
of sensor_msgs/Image and CompressedImage into (H, W, 3) uint8 RGB arrays, or raise FrameError
saying why the frame is unusable.

Work per message is bounded before any pixel is touched: a frame larger than MAX_FRAME_PIXELS or
more elongated than MAX_ASPECT_RATIO is refused from its header (raw fields, or the PNG IHDR /
JPEG SOF of a compressed image: a 100 KB PNG may claim 30000x30000 pixels, 2.7 GB decoded).
The frame gate (frames.py) decodes only the frames it samples.
"""

from __future__ import annotations

import array
import math
import re

import cv2
import numpy as np
import simplejpeg

SUPPORTED_ENCODINGS: tuple[str, ...] = ("rgb8", "bgr8", "rgba8", "bgra8", "mono8")

# Per encoding: bytes per pixel, and the channel slice that reads it as RGB (mono8 is then
# broadcast to three channels).
_LAYOUTS: dict[str, tuple[int, slice]] = {
    "rgb8": (3, slice(0, 3)),
    "bgr8": (3, slice(2, None, -1)),
    "rgba8": (4, slice(0, 3)),
    "bgra8": (4, slice(2, None, -1)),
    "mono8": (1, slice(0, 1)),
}

# ROS encodings with more than 8 bits per channel: depth images, 16-bit colour, float images.
_HIGH_DEPTH = re.compile(r"(mono|rgb|bgr|rgba|bgra)16|(16|32|64)[USF]C\d|bayer_\w+16")

ImageData = bytes | bytearray | memoryview | array.array | np.ndarray

# Size limits, checked from headers before decoding (parameters-to-be: max_frame_pixels). 8K UHD
# (7680 x 4320, 33 MP, 100 MB as RGB) is above any robot camera we know of and bounds one
# decode; the model sees at most pixel_budget pixels of it anyway.
MAX_FRAME_PIXELS = 7680 * 4320
# Qwen-VL's smart_resize refuses frames more elongated than 200:1 (chunks.smart_resize), which
# would fail the whole chunk in the worker; the gate refuses them instead, one frame at a time.
MAX_ASPECT_RATIO = 200

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers: C0-CF except DHT (C4), JPG (C8) and DAC (CC).
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_NO_LENGTH = frozenset(range(0xD0, 0xD8)) | {0x01}  # RSTn and TEM stand alone


class FrameError(ValueError):
    """A frame that cannot be used; the message says why (logged and counted by callers)."""


def stamp_to_seconds(sec: int, nanosec: int) -> float:
    """A header stamp as float seconds (arithmetic: nanosec may have fewer than 9 digits)."""
    return sec + nanosec * 1e-9


def decode_raw(
    encoding: str,
    height: int,
    width: int,
    step: int,
    data: ImageData,
    is_bigendian: bool = False,
) -> np.ndarray:
    """sensor_msgs/Image fields -> (height, width, 3) uint8 RGB, C-contiguous.

    `data` is read in place (rows may be padded: step >= width * channels); the only copy is the
    final channel conversion, so the result never aliases the message buffer. `is_bigendian` is
    accepted and ignored: byte order does not exist for 8-bit channels.
    """
    if encoding not in _LAYOUTS:
        supported = ", ".join(SUPPORTED_ENCODINGS)
        if _HIGH_DEPTH.fullmatch(encoding):
            raise FrameError(
                f"encoding {encoding!r}: depth / 16-bit / float images are not supported; "
                f"supported encodings: {supported}"
            )
        raise FrameError(f"unknown encoding {encoding!r}; supported encodings: {supported}")
    channels, rgb = _LAYOUTS[encoding]
    check_frame_size(height, width)
    row_bytes = width * channels
    if step < row_bytes:
        raise FrameError(
            f"step {step} smaller than width*channels = {width}*{channels} = {row_bytes}"
        )
    buffer = _byte_view(data)
    if buffer.size < step * height:
        raise FrameError(
            f"data shorter than step*height: {buffer.size} < {step}*{height} = {step * height}"
        )
    rows = buffer[: step * height].reshape(height, step)[:, :row_bytes]
    pixels = rows.reshape(height, width, channels)  # still a view: strides (step, channels, 1)
    return np.broadcast_to(pixels[..., rgb], (height, width, 3)).copy()


def decode_compressed(format: str, data: ImageData) -> np.ndarray:
    """sensor_msgs/CompressedImage -> (H, W, 3) uint8 RGB.

    The codec is read from the data itself (JPEG, PNG, ...); `format` only serves to refuse
    compressedDepth images, whose PNG carries 16-bit depth behind a private header. JPEG is
    decoded by libjpeg-turbo in strict mode (simplejpeg): data libjpeg finds corrupt is refused,
    where OpenCV's decoder would print "Corrupt JPEG data" and return the damaged picture.
    """
    if "compresseddepth" in format.lower():
        raise FrameError(f"format {format!r}: depth images are not supported")
    buffer = _byte_view(data)
    if buffer.size == 0:
        raise FrameError("empty compressed image data")
    try:
        height, width = compressed_size(buffer)
    except FrameError as error:
        raise FrameError(f"cannot decode compressed image ({format!r}): {error}") from None
    check_frame_size(height, width)
    if bytes(buffer[:2]) == b"\xff\xd8":
        try:
            return simplejpeg.decode_jpeg(buffer, colorspace="RGB", strict=True)
        except ValueError as error:
            raise FrameError(f"corrupt JPEG ({format!r}): {error}") from None
    try:
        bgr = cv2.imdecode(buffer, cv2.IMREAD_COLOR)
    except cv2.error as error:
        raise FrameError(f"cannot decode compressed image ({format!r}): {error}") from error
    if bgr is None:
        raise FrameError(f"cannot decode compressed image ({format!r}): corrupt or unknown data")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def check_frame_size(height: int, width: int) -> None:
    """FrameError unless a height x width frame is non-empty and within the size limits."""
    if height <= 0 or width <= 0:
        raise FrameError(f"empty image: height={height}, width={width}")
    if height * width > MAX_FRAME_PIXELS:
        raise FrameError(f"image of {width}x{height} pixels is larger than the limit of "
                         f"{MAX_FRAME_PIXELS} pixels (frames are refused before decoding)")
    if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
        raise FrameError(f"image of {width}x{height} pixels is more elongated than "
                         f"{MAX_ASPECT_RATIO}:1, which the model cannot take")


def compressed_size(data: np.ndarray) -> tuple[int, int]:
    """(height, width) from a PNG or JPEG header, without decoding: (N,) uint8 -> two ints.

    Only PNG and JPEG are accepted (what image_transport's compressed plugin sends): other codecs
    would be decoded with no size known beforehand. A JPEG must also end with its end-of-image
    marker: libjpeg silently fills a truncated JPEG with grey, which we refuse as corrupt.
    """
    head = memoryview(data)
    if bytes(head[:8]) == _PNG_SIGNATURE:
        if len(head) < 24 or bytes(head[12:16]) != b"IHDR":
            raise FrameError("corrupt PNG: no IHDR header")
        width = int.from_bytes(head[16:20], "big")
        height = int.from_bytes(head[20:24], "big")
        return height, width
    if bytes(head[:2]) == b"\xff\xd8":
        height, width = _jpeg_size(head)
        if not bytes(head[-64:]).rstrip(b"\0").endswith(b"\xff\xd9"):
            raise FrameError("corrupt JPEG: truncated (no end-of-image marker)")
        return height, width
    raise FrameError("not PNG or JPEG data")


def _jpeg_size(data: memoryview) -> tuple[int, int]:
    """(height, width) from a JPEG's start-of-frame segment, hopping over the segments before it;
    each step advances, so the loop ends within len(data) steps."""
    i, end = 2, len(data)
    while i < end:
        if data[i] != 0xFF:
            raise FrameError("corrupt JPEG: bad marker before the frame header")
        while i < end and data[i] == 0xFF:  # fill bytes may pad any marker
            i += 1
        if i + 1 > end:
            break
        marker = data[i]
        i += 1
        if marker in _JPEG_NO_LENGTH:
            continue
        if marker in (0xD9, 0xDA):  # end of image / start of scan before any frame header
            break
        if i + 2 > end:
            break
        length = data[i] << 8 | data[i + 1]
        if marker in _JPEG_SOF:
            if length < 8 or i + 7 > end:
                break
            height = data[i + 3] << 8 | data[i + 4]
            width = data[i + 5] << 8 | data[i + 6]
            if height == 0:
                raise FrameError("JPEG with its height in a DNL segment is not supported")
            return height, width
        if length < 2:
            raise FrameError("corrupt JPEG: bad segment length")
        i += length
    raise FrameError("corrupt JPEG: no frame header")


def _byte_view(data: ImageData) -> np.ndarray:
    """(N,) uint8 view of a message buffer, no copy; FrameError if it is not one."""
    try:
        return np.frombuffer(data, dtype=np.uint8)
    except (TypeError, ValueError) as error:
        raise FrameError(f"data is not a contiguous byte buffer: {error}") from error



UNSET_STAMP = math.nan  # what message_stamp gives for a header stamp never set


def message_stamp(msg) -> float:
    """Header stamp (s) of a sensor_msgs Image/CompressedImage from rclpy or `rosbags`;
    UNSET_STAMP (NaN) for an unset header (0 s 0 ns), which FrameGate refuses."""
    sec, nanosec = msg.header.stamp.sec, msg.header.stamp.nanosec
    if sec == 0 and nanosec == 0:
        return UNSET_STAMP
    return stamp_to_seconds(sec, nanosec)


def decode_message(msg) -> np.ndarray:
    """A sensor_msgs Image or CompressedImage (rclpy or `rosbags` object) -> (H, W, 3) RGB."""
    if hasattr(msg, "format"):
        return decode_compressed(msg.format, msg.data)
    return decode_raw(msg.encoding, msg.height, msg.width, msg.step, msg.data,
                      bool(msg.is_bigendian))

