"""Audio files for the transcription door (``POST /v1/audio/transcriptions``,
docs/openai.md, "Audio transcriptions"), without I/O: what a client uploads, decoded to
the speech model's input, mono PCM16 (little-endian) at its sample rate.

* **WAV** is read here: RIFF chunks, 16-bit PCM (format 1, or WAVE_FORMAT_EXTENSIBLE
  with the PCM subformat), any number of channels (mixed down), any sample rate
  (resampled). Other sample formats (8-bit, 24-bit, float) are refused by name rather
  than guessed at.
* **FLAC, MP3, Ogg Vorbis** are decoded by miniaudio (dr_flac, dr_mp3, stb_vorbis), as is
  any resampling.

Everything here is bounded before it costs: the container's own header gives the
duration, which is checked against ``max_seconds`` before a sample is decoded (an MP3
without one is scanned frame by frame, in time proportional to the bytes already capped
by the upload limit). A file that is not one of these formats, or that is cut short or
malformed, is refused with ``ValidationError`` (400, ``param`` ``file``) naming what is
wrong: never a 500, never a transcript of garbage.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from streamfleet.shared.errors import ErrorCode, ValidationError

__all__ = ["DecodedAudio", "decode_audio", "sniff_format", "resample_pcm16", "FORMATS"]

#: what the door decodes, as the refusals list it
FORMATS = "WAV (16-bit PCM), FLAC, MP3 or Ogg Vorbis"

#: WAVE_FORMAT_PCM, WAVE_FORMAT_IEEE_FLOAT, WAVE_FORMAT_EXTENSIBLE
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE
#: a data chunk size that means "to the end of the file" (WAV written to a pipe)
_UNKNOWN_SIZE = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class DecodedAudio:
    """An uploaded file as the speech model takes it."""

    pcm: bytes  # mono PCM16 little-endian at ``sample_rate``
    sample_rate: int
    format: str  # "wav", "flac", "mp3", "ogg"
    #: the file's own sample rate and channels, before conversion
    source_rate: int
    source_channels: int

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / 2 / self.sample_rate


def seconds_of(pcm: bytes, sample_rate: int) -> float:
    return len(pcm) / 2 / sample_rate


def _refuse(message: str) -> ValidationError:
    return ValidationError(message, code=ErrorCode.invalid_request, param="file")


def sniff_format(data: bytes) -> str:
    """The container of ``data`` by its first bytes: ``wav``, ``flac``, ``mp3``, ``ogg``.

    Raises:
        ValidationError: empty, another audio container (named), or not audio at all.
    """
    if not data:
        raise _refuse("the file is empty")
    head = data[:16]
    if head[:4] in (b"RIFF", b"RIFX", b"RF64"):
        if head[8:12] != b"WAVE":
            raise _refuse(f"the file is a RIFF file of type {head[8:12]!r}, not WAVE audio; send {FORMATS}")
        if head[:4] != b"RIFF":
            raise _refuse(f"{head[:4].decode()} WAV files are not supported (big-endian or 64-bit sizes); "
                          f"send a plain RIFF WAV, or {FORMATS}")
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        if b"OpusHead" in data[:256]:
            raise _refuse(f"Ogg Opus audio is not supported; send {FORMATS}")
        return "ogg"
    if head[:3] == b"ID3" or (len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0
                               and head[1] & 0x06 != 0):  # an MPEG audio frame sync, layer set
        return "mp3"
    if head[4:8] == b"ftyp":
        raise _refuse(f"MP4/M4A audio is not supported; send {FORMATS}")
    if head[:4] == b"\x1a\x45\xdf\xa3":
        raise _refuse(f"WebM/Matroska audio is not supported; send {FORMATS}")
    raise _refuse(f"the file is not audio in a format this server decodes; send {FORMATS}")


def decode_audio(data: bytes, sample_rate: int, max_seconds: float) -> DecodedAudio:
    """``data`` (a whole uploaded file) as mono PCM16 at ``sample_rate``.

    Blocking and CPU-bound (decoding, resampling): the door runs it in a thread.

    Raises:
        ValidationError: ``invalid_request`` (``file``): not a format decoded here, cut
            short, malformed, a sample format refused by name; ``out_of_range``
            (``file``): longer than ``max_seconds``.
    """
    fmt = sniff_format(data)
    if fmt == "wav":
        return _decode_wav(data, sample_rate, max_seconds)
    return _decode_compressed(data, fmt, sample_rate, max_seconds)


def _too_long(seconds: float, max_seconds: float) -> ValidationError:
    return ValidationError(f"the audio is {seconds:.1f} s long; the limit is {max_seconds:g} s "
                           f"(SF_TRANSCRIPTION_MAX_DURATION_S)", code=ErrorCode.out_of_range, param="file")


# -- WAV -----------------------------------------------------------------------------------
def _decode_wav(data: bytes, sample_rate: int, max_seconds: float) -> DecodedAudio:
    fmt: tuple[int, int, int, int, int] | None = None  # format, channels, rate, block align, bits
    pos = 12
    while True:
        if pos + 8 > len(data):
            missing = "'fmt ' chunk" if fmt is None else "'data' chunk"
            raise _refuse(f"the WAV file is truncated or malformed: it has no {missing}")
        cid, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if cid == b"fmt ":
            if size < 16 or body + size > len(data):
                raise _refuse("the WAV file is truncated or malformed: its 'fmt ' chunk is cut short")
            tag, channels, rate, _, align, bits = struct.unpack_from("<HHIIHH", data, body)
            if tag == _EXTENSIBLE:
                if size < 40:
                    raise _refuse("the WAV file is malformed: its extensible 'fmt ' chunk is cut short")
                tag = struct.unpack_from("<H", data, body + 24)[0]  # the subformat GUID's first field
            fmt = (tag, channels, rate, align, bits)
        elif cid == b"data":
            if fmt is None:
                raise _refuse("the WAV file is malformed: its 'data' chunk comes before its 'fmt ' chunk")
            end = len(data) if size == _UNKNOWN_SIZE else body + size
            if end > len(data):
                raise _refuse(f"the WAV file is truncated: its data chunk declares {size} bytes, "
                              f"{len(data) - body} are present")
            return _wav_samples(data[body:end], *fmt, sample_rate=sample_rate, max_seconds=max_seconds)
        pos = body + size + (size & 1)  # chunks are padded to even sizes


def _wav_samples(raw: bytes, tag: int, channels: int, rate: int, align: int, bits: int, *, sample_rate: int,
                 max_seconds: float) -> DecodedAudio:
    if tag == _FLOAT:
        raise _refuse(f"{bits}-bit floating-point WAV is not supported; send 16-bit PCM WAV (or FLAC, MP3, Ogg "
                      f"Vorbis)")
    if tag != _PCM:
        raise _refuse(f"WAV sample format {tag:#06x} (compressed) is not supported; send 16-bit PCM WAV")
    if bits != 16:
        raise _refuse(f"{bits}-bit PCM WAV is not supported; send 16-bit PCM WAV (or FLAC, MP3, Ogg Vorbis)")
    if not 1 <= channels <= 8:
        raise _refuse(f"the WAV file has {channels} channels; 1 to 8 are supported")
    if not 1000 <= rate <= 384_000:
        raise _refuse(f"the WAV file's sample rate of {rate} Hz is not supported (1000 to 384000 Hz)")
    if align != 2 * channels:
        raise _refuse(f"the WAV file is malformed: a block of {channels} 16-bit channels is {2 * channels} bytes, "
                      f"its header says {align}")
    if len(raw) % align:
        raise _refuse(f"the WAV file is truncated: its data ({len(raw)} bytes) is not whole {align}-byte sample "
                      f"frames")
    seconds = len(raw) / align / rate
    if seconds > max_seconds:
        raise _too_long(seconds, max_seconds)
    if channels == 1 and rate == sample_rate:
        return DecodedAudio(raw, sample_rate, "wav", rate, channels)
    pcm = raw
    if channels > 1:
        frames = np.frombuffer(raw, dtype="<i2").reshape(-1, channels)
        pcm = np.round(frames.mean(axis=1, dtype=np.float64)).astype("<i2").tobytes()
    if rate != sample_rate:
        pcm = resample_pcm16(pcm, rate, sample_rate)
    return DecodedAudio(pcm, sample_rate, "wav", rate, channels)


def resample_pcm16(pcm: bytes, source_rate: int, target_rate: int) -> bytes:
    """Mono PCM16 from ``source_rate`` to ``target_rate`` (miniaudio's resampler: linear
    interpolation behind a low-pass filter against aliasing)."""
    if source_rate == target_rate or not pcm:
        return pcm
    try:
        import miniaudio  # type: ignore[import-untyped]  # (it ships no type information)
    except ImportError as exc:  # a dependency; only a broken install lacks it
        raise _refuse(f"resampling from {source_rate} Hz is not available on this server (miniaudio is not "
                      f"installed); send {target_rate} Hz audio") from exc
    out = miniaudio.convert_frames(miniaudio.SampleFormat.SIGNED16, 1, source_rate, pcm,
                                   miniaudio.SampleFormat.SIGNED16, 1, target_rate)
    return bytes(out)


# -- FLAC, MP3, Ogg Vorbis -------------------------------------------------------------------
_NAMES = {"flac": "FLAC", "mp3": "MP3", "ogg": "Ogg Vorbis"}


def _decode_compressed(data: bytes, fmt: str, sample_rate: int, max_seconds: float) -> DecodedAudio:
    try:
        import miniaudio
    except ImportError as exc:  # a dependency; only a broken install lacks it
        raise _refuse(f"{_NAMES[fmt]} decoding is not available on this server (miniaudio is not installed); "
                      f"send 16-bit PCM WAV") from exc
    info_of = {"flac": miniaudio.flac_get_info, "mp3": miniaudio.mp3_get_info, "ogg": miniaudio.vorbis_get_info}[fmt]
    name = _NAMES[fmt]
    try:
        info = info_of(data)
    except miniaudio.MiniaudioError as exc:
        raise _refuse(f"the file is not valid {name} audio (it cannot be read: {exc})") from exc
    if info.sample_rate <= 0 or info.nchannels <= 0:
        raise _refuse(f"the {name} file is malformed: {info.nchannels} channels at {info.sample_rate} Hz")
    if info.num_frames > 0 and info.num_frames / info.sample_rate > max_seconds:
        raise _too_long(info.num_frames / info.sample_rate, max_seconds)
    # decoded a second at a time, stopping past the limit: a header that understated the
    # length (or gave none) costs at most ``max_seconds`` of samples
    limit = int(max_seconds * sample_rate) * 2
    pieces: list[bytes] = []
    size = 0
    try:
        for chunk in miniaudio.stream_memory(data, output_format=miniaudio.SampleFormat.SIGNED16, nchannels=1,
                                             sample_rate=sample_rate, frames_to_read=sample_rate):
            piece = chunk.tobytes()
            size += len(piece)
            if size > limit:
                raise _too_long(size / 2 / sample_rate, max_seconds)
            pieces.append(piece)
    except miniaudio.MiniaudioError as exc:
        raise _refuse(f"the file is not valid {name} audio (it cannot be decoded: {exc})") from exc
    pcm = b"".join(pieces)
    if not pcm:
        raise _refuse(f"the {name} file holds no audio")
    declared = info.num_frames / info.sample_rate
    if info.num_frames > 0 and seconds_of(pcm, sample_rate) < declared - 0.05:
        raise _refuse(f"the {name} file is truncated: its header declares {declared:.2f} s of audio, "
                      f"{seconds_of(pcm, sample_rate):.2f} s could be decoded")
    return DecodedAudio(pcm, sample_rate, fmt, info.sample_rate, info.nchannels)
