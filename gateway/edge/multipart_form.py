"""A ``multipart/form-data`` body read within limits, without I/O (the transcription door,
docs/openai.md, "Audio transcriptions").

``FormReader`` is fed the body as it arrives (python-multipart's streaming parser) and
keeps what the form holds: one file part, named ``file``, in memory, and short text
fields. Every byte a client sends is bounded before it is kept: the parts, the headers of
each part (python-multipart's own caps), the file and each field; nothing is spooled to
disk. A body past a limit is refused at the byte that crosses it, naming the part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from python_multipart.multipart import MultipartParseError, MultipartParser, parse_options_header

from streamfleet.shared.errors import ErrorCode, ValidationError

__all__ = ["FormLimits", "FormReader", "UploadedForm", "FILE_FIELD"]

#: the form field that carries the audio
FILE_FIELD = "file"
MAX_NAME_CHARS = 128


@dataclass(frozen=True, slots=True)
class FormLimits:
    #: the file part's bytes
    max_file_bytes: int
    #: each text field's bytes
    max_field_bytes: int = 16_384
    #: parts in all, the file's included
    max_parts: int = 64
    #: header lines of one part, and bytes of one header line
    max_part_headers: int = 8
    max_header_bytes: int = 4096


@dataclass(slots=True)
class UploadedForm:
    """What a form held: the file's bytes (None: no file part), its name and type as the
    client gave them, and every text field's values."""

    file: bytes | None = None
    filename: str | None = None
    content_type: str | None = None
    fields: dict[str, list[str]] = field(default_factory=dict)


class FormReader:
    """One multipart body, fed as it arrives.

    Raises (from the constructor, ``feed`` and ``finish``):
        ValidationError: ``invalid_request`` — not ``multipart/form-data``, malformed, cut
            short, no file; ``frame_too_large`` — the file or a field past its limit.
    """

    def __init__(self, content_type: str | None, limits: FormLimits) -> None:
        kind, options = parse_options_header(content_type or "")
        if kind.lower() != b"multipart/form-data":
            shown = (content_type or "none")[:64]
            raise ValidationError(f"the body must be multipart/form-data (a form with the audio in its 'file' "
                                  f"field), not {shown}", code=ErrorCode.invalid_request, param="file")
        boundary = options.get(b"boundary")
        if not boundary or len(boundary) > 70:
            raise ValidationError("the multipart/form-data Content-Type has no valid boundary",
                                  code=ErrorCode.invalid_request, param="file")
        self.limits = limits
        self.form = UploadedForm()
        self._parts = 0
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._name: str | None = None
        self._is_file = False
        self._buffer = bytearray()
        self._ended = False
        self._parser = MultipartParser(boundary, callbacks={
            "on_part_begin": self._part_begin, "on_header_field": self._header_field,
            "on_header_value": self._header_value_, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished, "on_part_data": self._part_data,
            "on_part_end": self._part_end, "on_end": self._end,
        }, max_header_count=limits.max_part_headers, max_header_size=limits.max_header_bytes)

    # -- feeding -------------------------------------------------------------------------
    def feed(self, chunk: bytes) -> None:
        try:
            self._parser.write(chunk)
        except ValidationError:
            raise
        except MultipartParseError as exc:
            raise ValidationError(f"the multipart/form-data body is malformed: {exc}"[:300],
                                  code=ErrorCode.invalid_request, param="file") from None

    def finish(self) -> UploadedForm:
        if not self._ended:
            raise ValidationError("the multipart/form-data body is cut short (no closing boundary)",
                                  code=ErrorCode.invalid_request, param="file")
        if self.form.file is None:
            raise ValidationError("the form has no 'file' field: send the audio as a file part named 'file'",
                                  code=ErrorCode.missing_field, param="file")
        return self.form

    # -- the parser's callbacks ---------------------------------------------------------
    def _part_begin(self) -> None:
        self._parts += 1
        if self._parts > self.limits.max_parts:
            raise ValidationError(f"the form has more than {self.limits.max_parts} parts",
                                  code=ErrorCode.invalid_request, param="file")
        self._headers.clear()
        self._name, self._is_file = None, False
        self._buffer = bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_value_(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        self._headers[bytes(self._header_name).lower()] = bytes(self._header_value)
        self._header_name, self._header_value = bytearray(), bytearray()

    def _headers_finished(self) -> None:
        disposition = self._headers.get(b"content-disposition")
        kind, options = parse_options_header(disposition) if disposition else (b"", {})
        raw_name = options.get(b"name")
        if kind.lower() != b"form-data" or raw_name is None:
            raise ValidationError("a part of the form has no Content-Disposition: form-data with a name",
                                  code=ErrorCode.invalid_request, param="file")
        name = raw_name.decode("utf-8", "replace")
        if not name or len(name) > MAX_NAME_CHARS:
            raise ValidationError(f"a form field name must have 1 to {MAX_NAME_CHARS} characters",
                                  code=ErrorCode.invalid_request, param="file")
        self._name = name
        if name == FILE_FIELD:
            if self.form.file is not None:
                raise ValidationError("the form has more than one 'file'; send one file per request",
                                      code=ErrorCode.invalid_request, param="file")
            self._is_file = True
            filename = options.get(b"filename")
            self.form.filename = filename.decode("utf-8", "replace")[:256] if filename is not None else None
            ctype = self._headers.get(b"content-type")
            self.form.content_type = ctype.decode("latin-1")[:128] if ctype else None

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        self._buffer += data[start:end]
        if self._is_file:
            if len(self._buffer) > self.limits.max_file_bytes:
                raise ValidationError(f"the file is larger than {self.limits.max_file_bytes} bytes, the limit "
                                      f"(SF_TRANSCRIPTION_MAX_BYTES)", code=ErrorCode.frame_too_large, param="file")
        elif len(self._buffer) > self.limits.max_field_bytes:
            name = self._name or ""  # (set by ``_headers_finished`` before any data)
            raise ValidationError(f"the form field {name[:32]!r} is longer than {self.limits.max_field_bytes} "
                                  f"bytes", code=ErrorCode.frame_too_large, param=name)

    def _part_end(self) -> None:
        if self._is_file:
            self.form.file = bytes(self._buffer)
        else:
            name = self._name or ""  # (set by ``_headers_finished`` before any data)
            try:
                value = self._buffer.decode("utf-8")
            except UnicodeDecodeError:
                raise ValidationError(f"the form field {name[:32]!r} is not UTF-8 text",
                                      code=ErrorCode.invalid_request, param=name) from None
            self.form.fields.setdefault(name, []).append(value)
        self._buffer = bytearray()

    def _end(self) -> None:
        self._ended = True
