"""Model bundles: checkpoint versions and reduced-precision variants of them in one zip
file, tagged (the design record ../shared/spec/004, adapted to embeddings).

    tags.txt               one tag per line, oldest first, newest last; tags are valid
                           file names, unique ignoring case
    <tag>/config.json      the run's config (as in a checkpoint's config.json)
    <tag>/params.txt       one line per parameter: "<name> <ref>", or "<name> <ref> <scale ref>"
                           for an int8 array q [N, D] with a float32 scale per row s [N]
                           (value = q * s[:, None])
    <tag>/params/<n>.npy   the arrays (.npy, never pickles): float32, float16 or int8
    <tag>/updater.txt      optional: "<name> <ref>" Adagrad accumulators, same shape as the
    <tag>/updater/<n>.npy  parameter ([N] per entity partition: PBG's row-Adagrad)

Names are `embeddings/{type}/{part}` (entity partitions, [N, D]) and the checkpoint's
public parameter names (`relations/{idx}/operator/{side}/{param}`,
`entities/{type}/global_embedding`), percent-encoded. A ref is `<n>` (this tag's file) or
`<tag>/<n>` (another tag's): identical arrays are stored once and shared by reference.

    from pbg_ray.checkpoints import bundle
    with bundle.load("model.zip") as model:         # the newest tag; tag="v3-int8" picks one
        model.embeddings("user", 0)                   # float32 [N, D], read on first use
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
import zipfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple
from urllib.parse import quote, unquote

import numpy as np

from pbg_ray.checkpoints.directory import row_adagrad_state, row_adagrad_sums
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.checkpoints.per_partition import MapPartitions, in_process
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError, did_you_mean
from pbg_ray.io.entities import num_relation_ids
from pbg_ray.io.files import PathLike, atomic_path
from pbg_ray.io.storage import storage_path
from pbg_ray.model.params import ModelParams, params_from_checkpoint, params_to_checkpoint

TAGS_FILE = "tags.txt"
BUNDLE_FILE = "bundle.zip"  # python -m pbg_ray.export export.format=bundle writes <output>/bundle.zip
PARAMS, UPDATER = "params", "updater"
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_REF = re.compile(r"(?:(?P<tag>[^/\s]+)/)?(?P<index>\d+)")


def embeddings_name(entity: str, part: int) -> str:
    return f"embeddings/{entity}/{part}"


def check_tags(tags: Sequence[str], where: str) -> None:
    """Tags must be valid file names and unique ignoring case."""
    seen: Dict[str, str] = {}
    for tag in tags:
        if not _TAG.fullmatch(tag):
            raise PbgRayError(f"{where}: tag {tag!r} is not a valid file name (letters, digits, "
                              "'.', '_', '-', at most 128, not starting with '.' or '-').")
        if tag.lower() in seen:
            raise PbgRayError(f"{where}: tag {tag!r} is listed twice (as {seen[tag.lower()]!r}; "
                              "tags are compared ignoring case). Keep one of them.")
        seen[tag.lower()] = tag


def quantize_int8(values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row int8: (q int8 [N, D], scale float32 [N]) with values ~ q * scale."""
    values = np.asarray(values, np.float32)
    scale = (np.abs(values).max(axis=1) / 127).astype(np.float32)
    q = np.rint(values / np.where(scale > 0, scale, 1)[:, None])
    return np.clip(q, -127, 127).astype(np.int8), scale


def _digest(array: np.ndarray) -> str:
    h = hashlib.blake2b(f"{array.dtype.str}{array.shape}".encode(), digest_size=20)
    h.update(np.ascontiguousarray(array).data)
    return h.hexdigest()


# An array as stored: (digest, array) of each member, two for int8 (values, per-row scale).
Encoded = List[Tuple[str, np.ndarray]]


def encode(name: str, value: np.ndarray, precision: str = "fp32") -> Encoded:
    """A parameter's members in `precision` (fp32, fp16, or int8 for 2-D arrays)."""
    value = np.asarray(value, np.float32)
    if precision == "int8":
        arrays = list(quantize_int8(value))
    elif precision == "fp16":
        half = value.astype(np.float16)
        if not np.isfinite(half).all() and np.isfinite(value).all():
            raise PbgRayError(f"{name}: values up to {np.abs(value).max():.3g} exceed float16's "
                              "range. Export it as int8 or fp32.")
        arrays = [half]
    else:
        arrays = [value]
    return [(_digest(a), a) for a in arrays]


class BundleWriter:
    """Writes a bundle (to a local path or a URI); use as a context manager. The file
    appears only when complete.

    put / put_updater may come in any order of tags (so each partition is read once for
    all its variants); tags.txt lists `tags` in the given order."""

    def __init__(self, path: PathLike, tags: Sequence[str]) -> None:
        check_tags(tags, f"bundle {str(path)!r}")
        self.path = storage_path(path)
        self.tags = list(tags)
        self._lines: Dict[Tuple[str, str], Dict[str, str]] = {
            (tag, kind): {} for tag in tags for kind in (PARAMS, UPDATER)}
        self._stored: Dict[Tuple[str, str], Tuple[str, int]] = {}  # (kind, digest) -> owner
        self._counts: Dict[Tuple[str, str], int] = {}
        self._sizes: Dict[str, int] = {}  # member -> bytes
        self._param_members: Dict[str, set] = {tag: set() for tag in tags}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "BundleWriter":
        tmp = self._stack.enter_context(atomic_path(self.path))
        self._zip = self._stack.enter_context(zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED))
        return self

    def __exit__(self, *exc) -> bool:
        if exc[0] is None:
            self._zip.writestr(TAGS_FILE, "".join(f"{t}\n" for t in self.tags))
            for (tag, kind), lines in self._lines.items():
                if lines or kind == PARAMS:
                    self._zip.writestr(f"{tag}/{kind}.txt", "".join(
                        f"{quote(name)} {refs}\n" for name, refs in lines.items()))
        return self._stack.__exit__(*exc)

    def set_config(self, tag: str, config: ConfigSchema) -> None:
        self._zip.writestr(f"{tag}/config.json", json.dumps(config.to_dict(), indent=4))

    def _store(self, tag: str, kind: str, digest: str, array: np.ndarray) -> str:
        """The ref of `array` from `tag`, written unless an identical one already is."""
        key = (kind, digest)
        if key not in self._stored:
            index = self._counts.get((tag, kind), 0)
            self._counts[tag, kind] = index + 1
            member = f"{tag}/{kind}/{index}.npy"
            with self._zip.open(member, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(array), allow_pickle=False)
            self._sizes[member] = self._zip.getinfo(member).file_size
            self._stored[key] = (tag, index)
        owner, index = self._stored[key]
        if kind == PARAMS:
            self._param_members[tag].add(f"{owner}/{kind}/{index}.npy")
        return str(index) if owner == tag else f"{owner}/{index}"

    def _add(self, tag: str, kind: str, name: str, refs: str) -> None:
        lines = self._lines[tag, kind]
        if name in lines:
            raise ValueError(f"{name!r} put twice into {tag}/{kind}.txt")  # a caller's bug
        lines[name] = refs

    def put(self, tag: str, name: str, value: np.ndarray, precision: str = "fp32") -> None:
        """A parameter of `tag`, stored in `precision` (see `encode`)."""
        self.put_encoded(tag, PARAMS, name, encode(name, value, precision))

    def put_updater(self, tag: str, name: str, sums: np.ndarray) -> None:
        """The Adagrad accumulator of parameter `name` (float32, kept at full precision)."""
        self.put_encoded(tag, UPDATER, name, encode(name, sums))

    def put_encoded(self, tag: str, kind: str, name: str, encoded: Encoded) -> None:
        """A parameter (kind PARAMS) or accumulator (UPDATER) of `tag` as `encode` made it."""
        self._add(tag, kind, name, " ".join(self._store(tag, kind, d, a) for d, a in encoded))

    def param_bytes(self, tag: str) -> int:
        """Bytes of the members `tag`'s parameters read (shared ones included)."""
        return sum(self._sizes[m] for m in self._param_members[tag])


@dataclasses.dataclass
class _Entry:
    member: str
    scale: Optional[str] = None  # member of the per-row scale of an int8 array


class Bundle:
    """One tag of a bundle file, open for reading; members are read when asked for.

    The whole bundle's structure is checked on opening: tags.txt, every tag's listing,
    and that every reference names a tag and a member that exist."""

    def __init__(self, path: PathLike, tag: Optional[str] = None) -> None:
        self.path = Path(path)
        where = f"model bundle {str(self.path)!r}"
        if not self.path.is_file():
            raise PbgRayError(f"{where} does not exist.")
        try:
            self._zip = zipfile.ZipFile(self.path)
        except (zipfile.BadZipFile, OSError) as err:
            raise PbgRayError(f"{where} is not a readable zip file ({err}).") from None
        try:
            self._members = set(self._zip.namelist())
            self.tags = self._text(TAGS_FILE).splitlines()
            if not self.tags:
                raise PbgRayError(f"{where}: {TAGS_FILE} lists no tag.")
            check_tags(self.tags, f"{where}: {TAGS_FILE}")
            self._canonical = {t.lower(): t for t in self.tags}
            listings = {t: (self._listing(t, PARAMS), self._listing(t, UPDATER)) for t in self.tags}
            if tag is None:
                tag = self.tags[-1]
            elif tag.lower() not in self._canonical:
                raise PbgRayError(f"{where} has no tag {tag!r}{did_you_mean(tag, self.tags)}. "
                                  f"Tags: {', '.join(self.tags)}.")
            self.tag = self._canonical[tag.lower()]
            self._params, self._updater = listings[self.tag]
            self.config = ConfigSchema.from_dict(json.loads(self._text(f"{self.tag}/config.json")),
                                                 source=f"{where}: {self.tag}/config.json")
        except BaseException:
            self._zip.close()
            raise

    def _where(self, member: str) -> str:
        return f"model bundle {str(self.path)!r}, member {member!r}"

    def _text(self, member: str) -> str:
        if member not in self._members:
            raise PbgRayError(f"{self._where(member)} is missing. The bundle is damaged: export "
                              "it again (python -m pbg_ray.export export.format=bundle).")
        try:
            return self._zip.read(member).decode("utf-8")
        except (zipfile.BadZipFile, UnicodeDecodeError) as err:
            raise PbgRayError(f"{self._where(member)} can't be read: {err}") from None

    def _resolve(self, tag: str, kind: str, ref: str, listing: str) -> str:
        match = _REF.fullmatch(ref)
        owner = tag if match is None or match.group("tag") is None else match.group("tag")
        if match is None or owner.lower() not in self._canonical:
            problem = (f"reference {ref!r} is malformed" if match is None
                       else f"refers to tag {owner!r}, which is not in {TAGS_FILE}")
            raise PbgRayError(f"{self._where(listing)}: {problem}. The bundle is inconsistent: "
                              "export it again.")
        member = f"{self._canonical[owner.lower()]}/{kind}/{match.group('index')}.npy"
        if member not in self._members:
            raise PbgRayError(f"{self._where(member)} (listed in {listing}) is missing. The bundle "
                              "is damaged: export it again.")
        return member

    def _listing(self, tag: str, kind: str) -> Dict[str, _Entry]:
        """name -> members of `tag`'s params.txt or updater.txt (optional: {})."""
        listing = f"{tag}/{kind}.txt"
        if kind == UPDATER and listing not in self._members:
            return {}
        entries: Dict[str, _Entry] = {}
        for line in self._text(listing).splitlines():
            name, *refs = line.split(" ")
            name = unquote(name)
            if not 1 <= len(refs) <= (2 if kind == PARAMS else 1) or name in entries:
                raise PbgRayError(f"{self._where(listing)}: line {line[:80]!r} is malformed or "
                                  "repeats a name. The bundle is inconsistent: export it again.")
            members = [self._resolve(tag, kind, ref, listing) for ref in refs]
            entries[name] = _Entry(*members)
        return entries

    def _read(self, member: str) -> np.ndarray:
        try:
            with self._zip.open(member) as f:
                return np.lib.format.read_array(f, allow_pickle=False)
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as err:
            raise PbgRayError(f"{self._where(member)} can't be read ({err}). The bundle is "
                              "damaged: export it again.") from None

    # --- parameters -------------------------------------------------------

    def names(self) -> List[str]:
        """The parameter names of this tag, in its params.txt order."""
        return list(self._params)

    def array(self, name: str) -> np.ndarray:
        """A parameter as float32 (int8 and fp16 ones converted back)."""
        entry = self._params.get(name)
        if entry is None:
            raise PbgRayError(f"model bundle {str(self.path)!r}, tag {self.tag!r}, has no parameter "
                              f"{name!r}{did_you_mean(name, self._params)}.")
        value = self._read(entry.member)
        if entry.scale is None:
            return value.astype(np.float32, copy=False)
        scale = self._read(entry.scale)
        if value.ndim != 2 or scale.shape != value.shape[:1]:
            raise PbgRayError(f"{self._where(entry.member)}: int8 array {value.shape} and its "
                              f"scale {scale.shape} don't match. Export the bundle again.")
        return value.astype(np.float32) * scale.astype(np.float32)[:, None]

    def embeddings(self, entity: str, part: int) -> np.ndarray:
        """float32 [N, D] of an entity partition."""
        return self.array(embeddings_name(entity, part))

    def model_arrays(self) -> Dict[str, np.ndarray]:
        """Relation operator parameters and global embeddings, by public name."""
        return {n: self.array(n) for n in self._params if not n.startswith("embeddings/")}

    def updater(self, name: str) -> Optional[np.ndarray]:
        """The Adagrad accumulator of parameter `name`, None if this tag has none."""
        entry = self._updater.get(name)
        return None if entry is None else self._read(entry.member).astype(np.float32, copy=False)

    def param_bytes(self) -> int:
        """Bytes of the members this tag's parameters read (shared ones included)."""
        members = {m for e in self._params.values() for m in (e.member, e.scale) if m}
        return sum(self._zip.getinfo(m).file_size for m in members)

    # --- conversion -------------------------------------------------------

    def to_checkpoint(self, directory: PathLike) -> CheckpointManager:
        """This tag as version 1 of a v1 checkpoint in `directory` (optimizer states
        included where the tag has them)."""
        checkpoint = CheckpointManager(directory)
        checkpoint.prepare()
        config = dataclasses.replace(self.config, checkpoint_path=str(checkpoint.path))
        for entity, econf in config.entities.items():
            for part in range(econf.num_partitions):
                sums = self.updater(embeddings_name(entity, part))
                checkpoint.write_partition(
                    1, entity, part, self.embeddings(entity, part),
                    None if sums is None else row_adagrad_state(sums, config.lr))
        arrays = self.model_arrays()
        sums = {n: self.updater(n) for n in arrays}
        optim_state = (params_to_checkpoint(config, ModelParams(arrays, sums))[1]
                       if all(s is not None for s in sums.values()) else None)
        checkpoint.write_model(1, arrays, optim_state)
        checkpoint.write_config(config)
        checkpoint.switch_to(1)
        return checkpoint

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> "Bundle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(path: PathLike, tag: Optional[str] = None) -> Bundle:
    """Open tag `tag` (None: the newest, last in tags.txt) of the bundle at `path`."""
    return Bundle(path, tag)


def is_bundle(path: PathLike) -> bool:
    path = Path(path)
    return path.is_file() and zipfile.is_zipfile(path)


def variant_tag(version: int, precision: str) -> str:
    return f"v{version}" if precision == "fp32" else f"v{version}-{precision}"


def bundle_partition(checkpoint_path: str, version: int, entity: str, part: int,
                     precisions: Sequence[str]) -> Tuple[Dict[str, Encoded], Optional[Encoded]]:
    """One entity partition of a checkpoint version as `encode` makes it: per precision
    its members, and its Adagrad accumulator's (None if it has none)."""
    checkpoint = CheckpointManager(checkpoint_path)
    embeddings, state = checkpoint.read_partition(version, entity, part)
    sums = row_adagrad_sums(state, len(embeddings),
                            str(checkpoint.partition_file(version, entity, part)))
    name = embeddings_name(entity, part)
    return ({p: encode(name, embeddings, p) for p in precisions},
            None if sums is None else encode(name, sums))


def write_checkpoint_bundle(path: PathLike, config: ConfigSchema,
                            versions: Iterable[Tuple[CheckpointManager, int]],
                            variants: Sequence[str], run: MapPartitions = in_process
                            ) -> List[Dict[str, Any]]:
    """Checkpoint versions (checkpoint, version) as tags v{N} (fp32, with the optimizer
    states) and v{N}-fp16 / v{N}-int8 (entity embeddings reduced, everything else
    shared with the other tags). Per version the reduced variants come first, so the
    newest tag, which load() opens by default, is the newest version at full precision.
    Each entity partition is one job of `run` (bundle_partition), which reads it itself.
    Returns per tag {"tag", "version", "precision", "bytes" (of its parameters)}."""
    order = sorted(dict.fromkeys(variants), key=lambda p: p == "fp32")
    versions = list(versions)
    tags = [variant_tag(version, p) for _, version in versions for p in order]
    num_rel = num_relation_ids(config)
    keys = [(e, p) for e, econf in config.entities.items() for p in range(econf.num_partitions)]
    with BundleWriter(path, tags) as writer:
        for checkpoint, version in versions:
            arrays, optim_state = checkpoint.read_model(version)
            params = params_from_checkpoint(config, num_rel, arrays, optim_state)
            for precision in order:
                tag = variant_tag(version, precision)
                writer.set_config(tag, config)
                for name, value in params.arrays.items():
                    writer.put(tag, name, value)
                    if precision == "fp32":
                        writer.put_updater(tag, name, params.sums[name])
            jobs = [(str(checkpoint.path), version, e, p, order) for e, p in keys]
            for (entity, part), (encoded, sums) in zip(keys, run(bundle_partition, jobs)):
                name = embeddings_name(entity, part)
                for precision in order:
                    tag = variant_tag(version, precision)
                    writer.put_encoded(tag, PARAMS, name, encoded[precision])
                    if precision == "fp32" and sums is not None:
                        writer.put_encoded(tag, UPDATER, name, sums)
    return [{"tag": variant_tag(version, p), "version": version, "precision": p,
             "bytes": writer.param_bytes(variant_tag(version, p))}
            for _, version in versions for p in order]
