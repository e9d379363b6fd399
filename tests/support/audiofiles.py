"""Audio files made in the tests: WAV (the standard library's writer), and FLAC from a
minimal writer (mono 16-bit PCM in VERBATIM subframes: no compression, but a valid FLAC
stream with its STREAMINFO and every frame's CRCs), so the transcription door's decoders
are tested on files made here rather than ones committed or downloaded."""

from __future__ import annotations

import io
import struct
import wave

__all__ = ["flac_bytes", "wav_bytes"]


def wav_bytes(pcm: bytes, rate: int = 16000, channels: int = 1, width: int = 2) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(pcm)
    return out.getvalue()

BLOCK = 4096


def _crc8(data: bytes) -> int:
    crc = 0
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = ((crc << 1) ^ 0x07) & 0xFF if crc & 0x80 else (crc << 1) & 0xFF
    return crc


def _crc16(data: bytes) -> int:
    crc = 0
    for b in data:
        crc ^= b << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x8005) & 0xFFFF if crc & 0x8000 else (crc << 1) & 0xFFFF
    return crc


def _utf8_number(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    if n < 0x800:
        return bytes([0xC0 | n >> 6, 0x80 | n & 0x3F])
    return bytes([0xE0 | n >> 12, 0x80 | (n >> 6) & 0x3F, 0x80 | n & 0x3F])


def flac_bytes(pcm: bytes, rate: int = 16000) -> bytes:
    """``pcm`` (mono PCM16 little-endian) as a FLAC file."""
    samples = len(pcm) // 2
    info = struct.pack(">HH", BLOCK, BLOCK) + b"\0\0\0" + b"\0\0\0"
    # sample rate (20 bits), channels - 1 (3), bits per sample - 1 (5), total samples (36)
    packed = (rate << 44) | (0 << 41) | (15 << 36) | samples
    info += packed.to_bytes(8, "big") + b"\0" * 16
    out = bytearray(b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info)
    for n, i in enumerate(range(0, samples, BLOCK)):
        block = pcm[2 * i:2 * min(samples, i + BLOCK)]
        size = len(block) // 2
        # sync + fixed blocking; block size "16 bits at the end" (7), rate from STREAMINFO (0);
        # mono (0), 16-bit (4), reserved 0
        header = bytes([0xFF, 0xF8, 0x70, 0x08]) + _utf8_number(n) + struct.pack(">H", size - 1)
        header += bytes([_crc8(header)])
        body = bytes([0x02])  # VERBATIM subframe, no wasted bits
        body += struct.pack(f">{size}h", *struct.unpack(f"<{size}h", block))
        frame = header + body
        out += frame + struct.pack(">H", _crc16(frame))
    return bytes(out)
