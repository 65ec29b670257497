"""Decode only what a crop keeps: a JPEG's region (nvImageCodec) or a DCT-scaled whole (simplejpeg); docs/data.md.

    python -m classifier_engine fit --config CONFIG --data.decoder nvimgcodec    # what data.decoder=auto picks first
"""

import functools
import os
import struct
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")  # its own stderr lines; a failed decode is retried and named by us
SCALES = (8, 4, 2)  # the DCT scales (1/8, 1/4, 1/2) libjpeg-turbo decodes cheaply, smallest first
HUFFMAN_8BIT = (0xC0, 0xC1, 0xC2)  # SOF0/1/2 at 8 bits, what nvJPEG decodes; lossless, arithmetic, 12 bits: whole


@dataclass
class EncodedJpeg:
    """A JPEG a preset decodes in part: its bytes, its size as decoded (EXIF applied) and `whole`, its fallback (which
    names the file when the bytes are bad)."""

    data: bytes
    height: int
    width: int
    scalable: bool  # upright (no EXIF turn) and not CMYK: simplejpeg, which ignores EXIF and CMYK, may decode it
    whole: Callable[[], torch.Tensor]

    def size_proxy(self) -> torch.Tensor:
        """A (3, H, W) zero-stride view with no pixels: what a transform's make_params reads the size from."""
        return torch.empty(1, 1, 1, dtype=torch.uint8).expand(3, self.height, self.width)


def jpeg_header(data: bytes) -> Optional[tuple[int, int, int, int, int, int]]:
    """(SOF marker, bits per sample, colour components, height, width, EXIF orientation) of a JPEG's headers; None when
    not a JPEG."""
    if data[:2] != b"\xff\xd8":
        return None
    i, orientation = 2, 1
    while i + 9 < len(data) and data[i] == 0xFF:
        marker, length = data[i + 1], int.from_bytes(data[i + 2 : i + 4], "big")
        if marker == 0xE1 and data[i + 4 : i + 10] == b"Exif\0\0":
            orientation = _exif_orientation(data[i + 10 : i + 2 + length]) or orientation
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a frame header, not DHT/JPG/DAC
            height, width = struct.unpack(">HH", data[i + 5 : i + 9])
            return marker, data[i + 4], data[i + 9], height, width, orientation
        elif marker == 0xDA:  # scan data before any frame header
            return None
        standalone = marker == 0x01 or 0xD0 <= marker <= 0xD8  # TEM, RSTn, SOI: no length field
        i += 1 if marker == 0xFF else 2 if standalone else 2 + length  # 0xFF: a fill byte before a marker
    return None


def _exif_orientation(tiff: bytes) -> Optional[int]:
    order = "little" if tiff[:2] == b"II" else "big"
    ifd = int.from_bytes(tiff[4:8], order)
    for entry in range(ifd + 2, ifd + 2 + 12 * int.from_bytes(tiff[ifd : ifd + 2], order), 12):
        if int.from_bytes(tiff[entry : entry + 2], order) == 0x0112:
            value = int.from_bytes(tiff[entry + 8 : entry + 10], order)
            return value if 1 <= value <= 8 else None
    return None


def encoded_jpeg(data: bytes, whole: Callable[[], torch.Tensor]) -> Optional[EncodedJpeg]:
    """The JPEG to decode in part, or None for what is decoded whole: another format, a file cut short (no end
    marker: decoding the crop alone could miss that), a frame type the region decoder does not take."""
    header = jpeg_header(data)
    if header is None or not data.rstrip(b"\0").endswith(b"\xff\xd9"):
        return None
    marker, bits, components, height, width, orientation = header
    if marker not in HUFFMAN_8BIT or bits != 8 or components not in (1, 3, 4) or height == 0:
        return None
    if orientation >= 5:  # rotated a quarter turn: decoded transposed
        height, width = width, height
    return EncodedJpeg(data, height, width, orientation == 1 and components != 4, whole)


@functools.cache
def _nvimgcodec(pid: int):  # per process: a forked worker's copy of its parent's is kept, never torn down
    from nvidia import nvimgcodec  # the optional extra, checked in decoders.unavailable

    decoder = nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
                                 backends=[nvimgcodec.Backend(nvimgcodec.CPU_ONLY)], max_num_cpu_threads=1)
    params = nvimgcodec.DecodeParams(apply_exif_orientation=True, color_spec=nvimgcodec.SRGB,
                                     sample_format=nvimgcodec.I_RGB)
    return nvimgcodec, decoder, params


def nvimgcodec_decode(data: bytes, box: Optional[tuple[int, int, int, int]] = None) -> torch.Tensor:
    """uint8 RGB (3, H, W), a view of HWC memory: the whole image or its EXIF-upright (top, left, height, width) box;
    ValueError when nvImageCodec cannot decode it."""
    nvimgcodec, decoder, params = _nvimgcodec(os.getpid())
    stream = nvimgcodec.CodeStream(data)
    if box is not None:
        top, left, height, width = box
        stream = stream.get_sub_code_stream(region=nvimgcodec.Region(top, left, top + height, left + width))
    image = decoder.decode(stream, params=params)
    if image is None:
        raise ValueError("cannot decode the bytes (corrupt, cut short, or a format it lacks)")
    return torch.from_numpy(np.asarray(image.cpu())).permute(2, 0, 1)


def dct_scale(height: int, width: int, min_height: int, min_width: int) -> int:
    """The largest k of SCALES whose 1/k of (height, width) still covers (min_height, min_width); 1 when none."""
    return next((k for k in SCALES if height // k >= min_height and width // k >= min_width), 1)


def decode_box(image: EncodedJpeg, top: int, left: int, height: int, width: int,
               size: tuple[int, int]) -> torch.Tensor:
    """The pixels of a box at the smallest DCT scale that still covers `size` (h, w): the region alone at full scale,
    else the scaled whole cut to the box, its edges rounded to the scaled pixels."""
    k = dct_scale(height, width, *size)
    if k == 1:
        return _or_whole(image, (top, left, height, width))
    scaled = decode_at(image, k)
    sy, sx = scaled.shape[1] / image.height, scaled.shape[2] / image.width
    y0, x0 = round(top * sy), round(left * sx)
    return scaled[:, y0 : max(round((top + height) * sy), y0 + 1), x0 : max(round((left + width) * sx), x0 + 1)]


def decode_at(image: EncodedJpeg, k: int) -> torch.Tensor:
    """The whole at the DCT scale 1/k: simplejpeg (at 1/1 too: 4-6 % faster here, equal pixels), else nvImageCodec."""
    if image.scalable:
        import simplejpeg  # the optional extra's, with nvImageCodec

        try:  # libjpeg's 1/k output is ceil(size / k): asking for that picks exactly 1/k among its M/8 scales
            return torch.from_numpy(simplejpeg.decode_jpeg(image.data, "RGB", min_height=-(-image.height // k),
                                                           min_width=-(-image.width // k))).permute(2, 0, 1)
        except ValueError:
            pass
    return _or_whole(image, None)


def _or_whole(image: EncodedJpeg, box: Optional[tuple[int, int, int, int]]) -> torch.Tensor:
    try:
        return nvimgcodec_decode(image.data, box)
    except ValueError:  # the whole-image decoder decodes it or names the file
        whole = image.whole()
        top, left, height, width = box or (0, 0, *whole.shape[1:])
        return whole[:, top : top + height, left : left + width]
