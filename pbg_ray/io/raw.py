"""Raw edge tables (TSV, CSV, Parquet; text plain or compressed) read in Arrow record batches.

An importer input is a file, a directory of shards or a glob, on a local path or a URI
that pyarrow.fs opens (io/storage.py); `input_shards` lists its files (a directory's
files below it, names starting with `_` or `.` left out, as Spark's `_SUCCESS` and
`.crc`). `RawTable` streams one shard: a reader thread parses the next batch while
the caller works on the current one, so memory holds about two batches, never
the file. Rows that can't be edges (wrong number of fields, empty or null
names, weights that aren't numbers) stop the import with the file and line, or
are counted and left out with `importer.skip_bad_rows=true`. Compressed text (gzip, bzip2,
zstd, LZ4 frames) is told by its first bytes, whatever its name.
Settings: `importer.` (pbg_ray.config.importer.ImportConfig).
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import queue
import re
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pbg_ray.config.importer import ImportConfig
from pbg_ray.config.options import CREDENTIALS_FIX, carries_credentials
from pbg_ray.errors import PbgRayError, did_you_mean
from pbg_ray.io.storage import ObjectPath, StoragePath, is_uri, storage_path

FORMATS = ("tsv", "csv", "parquet")
# Codecs of compressed text (pyarrow's names) by the first bytes of their streams; bzip2's
# "BZh" is followed by a block size digit and a block's (or the end's) magic number, which
# no text starts with. Their suffixes are left out when the extension gives the format.
MAGIC_NUMBERS = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"),
                 (b"\x04\x22\x4d\x18", "lz4"))
BZIP2_START = re.compile(rb"BZh[1-9](\x31\x41\x59\x26\x53\x59|\x17\x72\x45\x38\x50\x90)")
COMPRESSION_SUFFIXES = (".gz", ".gzip", ".bz2", ".zst", ".zstd", ".lz4")
ROLES = ("lhs", "rel", "rhs", "weight")
CHECK_THE_FILE = "Check the file (a download or copy cut short?)."
TEXT_BLOCK_BYTES = 4 << 20  # bytes of text Arrow parses per batch
PARQUET_BATCH_ROWS = 1 << 17
MAX_EXAMPLES = 5  # bad rows quoted in the report
GLOB_CHARS = "*?["


def _file_system(path: StoragePath) -> Tuple[pafs.FileSystem, str]:
    """(pyarrow file system, its name of `path`) for local paths and URIs alike."""
    if isinstance(path, ObjectPath):
        return path.fs, path.fs_path
    return pafs.LocalFileSystem(), str(Path(path).absolute())


@dataclass(frozen=True)
class Shard:
    """One file of an importer input."""

    path: StoragePath
    size: int
    mtime_ns: Optional[int]


def _split_glob(spec: str) -> Tuple[str, Optional[str]]:
    """(the directory above the first path segment with a wildcard, the pattern below it);
    (spec, None) without wildcards."""
    parts = urlsplit(spec) if is_uri(spec) else None
    segments = (parts.path if parts else spec).split("/")
    first = next((i for i, s in enumerate(segments) if any(c in s for c in GLOB_CHARS)), None)
    if first is None:
        return spec, None
    base = "/".join(segments[:first]) or ("/" if segments[0] == "" else ".")
    return (urlunsplit(parts._replace(path=base)) if parts else base), "/".join(segments[first:])


@contextlib.contextmanager
def _storage_errors(what: str) -> Iterator[None]:
    """Failures to reach a file (network, permissions, credentials) as one clear line."""
    try:
        yield
    except OSError as err:
        raise PbgRayError(f"can't read {what}: {err}. Check the path, the credentials in the "
                          "environment (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or the "
                          "node's role) and the URI's endpoint settings.") from None


def input_shards(spec: str) -> List[Shard]:
    """The files of one importer input (a file, a directory or a glob), in name order."""
    if carries_credentials(spec):
        raise PbgRayError("an importer input's URI carries credentials; they would end up in "
                          f"logs and in the import's manifest. {CREDENTIALS_FIX}")
    base_spec, pattern = _split_glob(spec)
    base = storage_path(base_spec)
    fs, fs_path = _file_system(base)
    with _storage_errors(f"importer input {spec!r}"):
        info = fs.get_file_info(fs_path)
        if pattern is None and info.type == pafs.FileType.File:
            return [Shard(base, info.size, info.mtime_ns)]
        found = (fs.get_file_info(pafs.FileSelector(fs_path, recursive=True))
                 if info.type == pafs.FileType.Directory else [])
    shards = []
    for entry in sorted(found, key=lambda e: e.path):
        relative = entry.path[len(fs_path):].strip("/")
        hidden = any(s.startswith(("_", ".")) for s in relative.split("/"))
        if entry.type != pafs.FileType.File or hidden:
            continue
        if pattern is None or fnmatch.fnmatchcase(relative, pattern):
            shards.append(Shard(base / relative, entry.size, entry.mtime_ns))
    if not shards:
        what = "matches no file" if pattern else (
            "is an empty directory" if info.type == pafs.FileType.Directory else "does not exist")
        raise PbgRayError(f"importer input {spec!r} {what}. Give a file, a directory of "
                          "shards or a glob that matches files (check importer.inputs).")
    return shards


@dataclass
class RawBatch:
    """Consecutive data rows of one file. Names are Arrow string arrays."""

    lhs: pa.Array
    rhs: pa.Array
    rel: Optional[pa.Array]
    weight: Optional[np.ndarray]  # float32
    rows: np.ndarray  # int64 index of each row among the file's data rows

    def __len__(self) -> int:
        return len(self.lhs)

    def take(self, keep: np.ndarray) -> "RawBatch":
        """The rows where the boolean mask `keep` is true."""
        idx = pa.array(np.flatnonzero(keep))
        return RawBatch(self.lhs.take(idx), self.rhs.take(idx),
                        None if self.rel is None else self.rel.take(idx),
                        None if self.weight is None else self.weight[keep], self.rows[keep])


def detect_format(path: StoragePath, fmt: Optional[str]) -> str:
    if fmt is not None:
        if fmt not in FORMATS:
            raise PbgRayError(f"importer.format: unknown format {fmt!r}{did_you_mean(fmt, FORMATS)}. "
                              f"Valid values: {', '.join(FORMATS)} (or null to use the extension).")
        return fmt
    suffixes = [s.lower() for s in Path(path.name).suffixes
                if s.lower() not in COMPRESSION_SUFFIXES]
    ext = suffixes[-1] if suffixes else ""
    by_ext = {".tsv": "tsv", ".txt": "tsv", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
    if ext not in by_ext:
        raise PbgRayError(f"input file {str(path)!r}: can't tell the format from the extension "
                          f"{ext or '(none)'!r}. Set importer.format to one of {', '.join(FORMATS)}.")
    return by_ext[ext]


def text_codec(head: bytes) -> Optional[str]:
    """The codec of a text file whose first bytes are `head` (10 or more), None if plain."""
    if BZIP2_START.match(head):
        return "bz2"
    return next((codec for magic, codec in MAGIC_NUMBERS if head.startswith(magic)), None)


class RawTable:
    """One raw input file (a shard of an input); iterate `batches()` once."""

    def __init__(self, path: Any, settings: ImportConfig) -> None:
        self.path = storage_path(path)
        self.settings = settings
        self._fs, self._fs_path = _file_system(self.path)
        with self._reading():
            info = self._fs.get_file_info(self._fs_path)
        if info.type != pafs.FileType.File:
            raise PbgRayError(f"input file {str(path)!r} does not exist. Check importer.inputs.")
        if info.size == 0:
            raise PbgRayError(f"input file {str(path)!r} is empty. Give a file with at least "
                              "one edge.")
        self.format = detect_format(self.path, settings.format)
        self.codec: Optional[str] = None  # of compressed text
        if self.format != "parquet":
            with self._reading(), self._fs.open_input_stream(self._fs_path,
                                                             compression=None) as f:
                self.codec = text_codec(f.read(10))
        self.columns: Dict[str, Optional[int]] = {}  # role -> column index
        self.num_rows = 0
        self.bad_rows = 0
        self.bad_examples: List[str] = []
        self._row_group_starts: Optional[np.ndarray] = None
        self._header_lines = 0
        if self.format == "parquet":
            self._open_parquet()
        else:
            self._open_text()

    # --- opening ---------------------------------------------------------

    def _reading(self) -> Any:
        """A context in which storage failures become one line naming the file."""
        return _storage_errors(f"input file {str(self.path)!r}")

    def _resolve(self, names: Optional[List[str]], num_columns: int) -> None:
        """Role -> column index, refusing columns the file doesn't have."""
        for role in ROLES:
            spec = getattr(self.settings, f"{role}_col")
            if spec is None:
                if role in ("lhs", "rhs"):
                    raise PbgRayError(f"importer.{role}_col is required: the column of the "
                                      f"{role} entity names (an index or a column name).")
                self.columns[role] = None
            elif isinstance(spec, bool) or not isinstance(spec, (int, str)):
                raise PbgRayError(f"importer.{role}_col: expected a column index or name, got {spec!r}.")
            elif isinstance(spec, int):
                if not 0 <= spec < num_columns:
                    raise PbgRayError(
                        f"input file {str(self.path)!r} has {num_columns} column(s); "
                        f"importer.{role}_col={spec} is out of range. Use an index in "
                        f"0..{num_columns - 1}" + (f" or a name of {names}." if names else "."))
                self.columns[role] = spec
            else:
                if names is None:
                    raise PbgRayError(f"importer.{role}_col={spec!r} names a column, but "
                                      f"{str(self.path)!r} is read without a header. Set "
                                      "importer.header=true or give the column's index.")
                if spec not in names:
                    raise PbgRayError(f"input file {str(self.path)!r} has no column {spec!r}"
                                      f"{did_you_mean(spec, names)}. Its columns: {names}. "
                                      f"Fix importer.{role}_col.")
                self.columns[role] = names.index(spec)

    def _open_text_stream(self) -> pa.NativeFile:
        stream = self._fs.open_input_stream(self._fs_path, compression=None)
        return pa.CompressedInputStream(stream, self.codec) if self.codec else stream

    def _open_lines(self, errors: str = "strict") -> io.TextIOWrapper:
        return io.TextIOWrapper(self._open_text_stream(), encoding="utf-8", errors=errors,
                                newline="")

    def _open_text(self) -> None:
        settings = self.settings
        self.delimiter = settings.delimiter or ("\t" if self.format == "tsv" else ",")
        by_name = any(isinstance(getattr(settings, f"{r}_col"), str) for r in ROLES)
        header = by_name if settings.header is None else settings.header
        first = self._first_line()
        if first is None:
            raise PbgRayError(f"input file {str(self.path)!r} is empty (no lines). "
                              "Give a file with at least one edge.")
        fields = first.split(self.delimiter)
        names = [f.strip('"') for f in fields] if header else None
        self._header_lines = 1 if header else 0
        self._resolve(names, len(fields))
        self._num_columns = len(fields)

    def _first_line(self) -> Optional[str]:
        with self._reading():
            lines = self._open_lines()
        try:
            with lines as f:
                for line in f:
                    line = line.rstrip("\r\n")
                    if line:
                        return line
        except (OSError, UnicodeDecodeError, EOFError, zlib.error) as err:
            compressed = f"{self.codec}-compressed " if self.codec else ""
            raise PbgRayError(f"input file {str(self.path)!r} can't be read as "
                              f"{compressed}UTF-8 text: {err}. {CHECK_THE_FILE}") from None
        return None

    def _open_parquet(self) -> None:
        try:
            with self._reading():
                source = self._fs.open_input_file(self._fs_path)
            self._parquet = pq.ParquetFile(source, pre_buffer=False)
        except (pa.ArrowException, OSError) as err:
            raise PbgRayError(f"input file {str(self.path)!r} is not a readable Parquet file: "
                              f"{err}. Check the file or set importer.format.") from None
        meta = self._parquet.metadata
        if meta.num_rows == 0:
            raise PbgRayError(f"input file {str(self.path)!r} has no rows. "
                              "Give a file with at least one edge.")
        self._resolve(self._parquet.schema_arrow.names, len(self._parquet.schema_arrow.names))
        sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        self._row_group_starts = np.cumsum([0] + sizes)

    # --- reading ---------------------------------------------------------

    def _text_batches(self) -> Iterator[pa.RecordBatch]:
        wanted = sorted({i for i in self.columns.values() if i is not None})
        names = [f"f{i}" for i in range(self._num_columns)]

        def on_invalid_row(row) -> str:
            if self.settings.skip_bad_rows:
                self.bad_rows += 1
                if len(self.bad_examples) < MAX_EXAMPLES:
                    self.bad_examples.append(
                        f"{self._where_line(self._line_of_text(row.text))}: "
                        f"{row.actual_columns} fields instead of {row.expected_columns}: "
                        f"{row.text[:200]!r}")
                return "skip"
            self._invalid_text = row.text
            return "error"

        self._invalid_text = None
        try:
            yield from pacsv.open_csv(
                self._open_text_stream(),
                read_options=pacsv.ReadOptions(block_size=TEXT_BLOCK_BYTES, column_names=names,
                                               skip_rows=self._header_lines),
                parse_options=pacsv.ParseOptions(
                    delimiter=self.delimiter,
                    # TSV is split on the delimiter alone, as PBG does; CSV honours quotes.
                    quote_char='"' if self.format == "csv" else False, escape_char=False,
                    invalid_row_handler=on_invalid_row),
                convert_options=pacsv.ConvertOptions(
                    include_columns=[names[i] for i in wanted],
                    column_types={names[i]: pa.string() for i in wanted},
                    strings_can_be_null=False, quoted_strings_can_be_null=False))
        except pa.ArrowInvalid as err:
            if self._invalid_text is not None:
                line = self._line_of_text(self._invalid_text)
                raise PbgRayError(
                    f"{self._where_line(line)}: expected {self._num_columns} fields separated by "
                    f"{self.delimiter!r}, found {self._invalid_text[:200]!r}. Fix the line or set "
                    "importer.skip_bad_rows=true to leave such rows out.") from None
            raise PbgRayError(f"input file {str(self.path)!r} can't be parsed as "
                              f"{self.format.upper()}: {err}") from None
        except OSError as err:  # e.g. a compressed stream cut short
            raise PbgRayError(f"input file {str(self.path)!r}: reading failed: {err}. "
                              f"{CHECK_THE_FILE}") from None

    def _parquet_batches(self) -> Iterator[pa.RecordBatch]:
        names = self._parquet.schema_arrow.names
        wanted = sorted({i for i in self.columns.values() if i is not None})
        try:
            yield from self._parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS,
                                                  columns=[names[i] for i in wanted])
        except (pa.ArrowException, OSError) as err:
            raise PbgRayError(f"input file {str(self.path)!r}: reading failed: {err}") from None

    def _threaded(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Run `batches` in a reader thread, one batch ahead of the consumer."""
        handoff: queue.Queue = queue.Queue(maxsize=1)
        done = object()
        stop = threading.Event()

        def produce() -> None:
            try:
                for batch in batches:
                    if stop.is_set():
                        return
                    handoff.put(batch)
                handoff.put(done)
            except BaseException as err:  # handed to the consumer, raised there
                handoff.put(err)

        thread = threading.Thread(target=produce, daemon=True, name=f"read {self.path.name}")
        thread.start()
        try:
            while True:
                item = handoff.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    handoff.get(timeout=0.05)
                except queue.Empty:
                    pass

    def batches(self) -> Iterator[RawBatch]:
        source = self._parquet_batches() if self.format == "parquet" else self._text_batches()
        key = (lambda i: self._parquet.schema_arrow.names[i]) if self.format == "parquet" \
            else (lambda i: f"f{i}")
        for record_batch in self._threaded(source):
            if record_batch.num_rows == 0:
                continue
            rows = np.arange(self.num_rows, self.num_rows + record_batch.num_rows, dtype=np.int64)
            self.num_rows += record_batch.num_rows
            column = {role: None if idx is None else record_batch.column(key(idx))
                      for role, idx in self.columns.items()}
            batch = self._checked(column, rows)
            if len(batch):
                yield batch
        if self.num_rows == 0:
            raise PbgRayError(f"input file {str(self.path)!r} holds no edges"
                              f"{' after its header' if self._header_lines else ''}. "
                              "Give a file with at least one edge.")

    # --- bad rows ----------------------------------------------------------

    def _checked(self, column: Dict[str, Optional[pa.Array]], rows: np.ndarray) -> RawBatch:
        bad = np.zeros(len(rows), dtype=bool)
        reasons: List[tuple] = []
        for role in ("lhs", "rel", "rhs"):
            values = column[role]
            if values is None:
                continue
            if not pa.types.is_string(values.type) and not pa.types.is_large_string(values.type):
                values = column[role] = pc.cast(values, pa.string())
            lengths = pc.binary_length(values)
            if values.null_count or pc.min(lengths).as_py() == 0:  # else no name is missing
                missing = np.asarray(pc.fill_null(pc.equal(lengths, 0), True))
                bad |= missing
                reasons.append((missing, f"empty {role} name"))
        weight = None
        if column["weight"] is not None:
            weight, bad_weight = self._weights(column["weight"])
            if bad_weight.any():
                bad |= bad_weight
                reasons.append((bad_weight, "weight is not a number"))
        batch = RawBatch(column["lhs"], column["rhs"], column["rel"], weight, rows)
        if bad.any():
            self.refuse(batch, bad, " and ".join(r for _, r in reasons), "")
            batch = batch.take(~bad)
        return batch

    @staticmethod
    def _weights(values: pa.Array) -> tuple:
        try:
            weight = pc.cast(values, pa.float32())
            ok = np.asarray(pc.is_valid(weight))
        except pa.ArrowInvalid:
            # Slow path, only for files with bad weights: find which ones.
            parsed = []
            for v in values.to_pylist():
                try:
                    parsed.append(float(v))
                except (TypeError, ValueError):
                    parsed.append(None)
            weight = pa.array(parsed, pa.float32())
            ok = np.asarray(pc.is_valid(weight))
        return np.asarray(pc.fill_null(weight, 1.0), dtype=np.float32), ~ok

    def refuse(self, batch: RawBatch, bad: np.ndarray, reason: str, fix: str) -> None:
        """Rows of `batch` marked in `bad` can't be imported: count them when
        skip_bad_rows is set, else stop at the first with its file and line."""
        first = int(np.argmax(bad))
        if not self.settings.skip_bad_rows:
            raise PbgRayError(f"{self.where(int(batch.rows[first]))}: {reason}. "
                              f"{fix + ' ' if fix else ''}Fix the row or set "
                              "importer.skip_bad_rows=true to leave such rows out.")
        room = MAX_EXAMPLES - len(self.bad_examples)
        self.bad_examples += [f"{self.where(int(batch.rows[i]))}: {reason}"
                              for i in np.flatnonzero(bad)[:max(room, 0)]]
        self.bad_rows += int(bad.sum())

    # --- where a row is ----------------------------------------------------

    def where(self, row: int) -> str:
        """Names data row `row` (0-based) by file and line, or row group for Parquet."""
        if self.format == "parquet":
            group = int(np.searchsorted(self._row_group_starts, row, side="right")) - 1
            return (f"input file {str(self.path)!r}, row group {group}, row "
                    f"{row - int(self._row_group_starts[group])} of it (row {row} of the file)")
        return self._where_line(self._line_of_row(row))

    def _where_line(self, line: Optional[int]) -> str:
        return f"input file {str(self.path)!r}" + (f", line {line}" if line else "")

    def _scan_lines(self, stop: Callable[[int, str], bool]) -> Optional[int]:
        """The 1-based number of the first line (after the header) where `stop`
        holds, given the count of non-empty data lines before it. Only runs on errors."""
        seen = 0
        with self._reading():
            lines = self._open_lines(errors="replace")
        with lines as f:
            for number, line in enumerate(f, start=1):
                line = line.rstrip("\r\n")
                if number <= self._header_lines or not line:
                    continue  # Arrow skips the header and empty lines too
                if stop(seen, line):
                    return number
                seen += 1
        return None

    def _line_of_row(self, row: int) -> Optional[int]:
        return self._scan_lines(lambda seen, line: seen == row)

    def _line_of_text(self, text: str) -> Optional[int]:
        return self._scan_lines(lambda seen, line: line == text)
